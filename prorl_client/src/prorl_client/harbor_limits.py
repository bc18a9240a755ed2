"""What a Harbor task.toml asks of a run: its time limits, resources and network, checked.

The field names are Harbor's (harbor.models.task.config, task schema 1.x):
- `[agent] timeout_sec`: the agent's time. The server ends the agent there and judges
  what it left (Harbor records an AgentTimeoutError and still runs the verifier).
- `[verifier] timeout_sec`: the tests' time (Harbor's default 600 s when unset).
- `[environment] cpus`, `memory_mb` (or the older `memory = "4G"`): the sandbox's
  limits; `storage_mb` (or `storage`): recorded only (the sandboxes have no disk quota).
- Network: `[environment] allow_internet` (older) or `network_mode` ("public",
  "no-network", "allowlist" with `allowed_hosts`) in [environment], with [agent] /
  [verifier] overrides. The sandboxes have no network at all: a task that asks for it
  is refused, unless the operator says it runs without (`--no-internet-ok`). A task
  that says nothing (Harbor's default lets it reach the network) is taken: most need
  none.

Everything else in these three tables is either harmless here (build_timeout_sec,
setup_timeout_sec, skills_dir, gpu_types without gpus), refused when set to what this
server cannot give (gpus, tpu, Windows, MCP servers, variables from the host, a
user other than the sandbox's, healthchecks, a verifier environment or collect hooks
of its own), or unknown, and refused: an unknown field may be a limit that would not
be applied. Each refusal says which field, and why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_VERIFIER_TIMEOUT_S = 600.0
"""Harbor's VerifierConfig.timeout_sec when a task sets none."""
MAX_AGENT_TIMEOUT_S = 24 * 3600.0
MAX_VERIFIER_TIMEOUT_S = 3600.0
"""The terminal family's bounds (agents/terminal.py)."""
MIN_MEMORY_MIB = 16
SANDBOX_USERS = ("agent", "1000", 1000)
"""How a task may name the user the sandbox runs as (uid 1000, named agent in the local images)."""
NETWORK_MODES = ("public", "no-network", "allowlist")

_ENVIRONMENT_KEYS = frozenset(
    {
        "build_timeout_sec", "docker_image", "os", "cpus", "memory_mb", "storage_mb", "memory", "storage",
        "gpus", "gpu_types", "tpu", "allow_internet", "network_mode", "allowed_hosts", "mcp_servers", "env",
        "skills_dir", "healthcheck", "workdir",
    }
)  # fmt: skip
_AGENT_KEYS = frozenset({"timeout_sec", "setup_timeout_sec", "user", "network_mode", "allowed_hosts"})
_VERIFIER_KEYS = frozenset(
    {"timeout_sec", "env", "user", "network_mode", "allowed_hosts", "environment_mode", "environment", "collect"}
)


class Refused(Exception):
    """A task this server cannot run or judge; the message says why."""


@dataclass(frozen=True)
class TaskLimits:
    agent_timeout_s: float
    """0: the task sets none (the job's budget limits the agent)."""
    verifier_timeout_s: float
    cpus: int | None = None
    memory_mib: int | None = None
    storage_mib: int | None = None
    workdir: str | None = None
    """[environment] workdir: where commands run, over the image's WORKDIR."""

    def instance_fields(self) -> dict[str, Any]:
        """The terminal instance's fields for these limits (resources only when the task sets them)."""
        fields: dict[str, Any] = {
            "agent_timeout_s": self.agent_timeout_s,
            "verifier_timeout_s": self.verifier_timeout_s,
        }
        for name in ("cpus", "memory_mib", "storage_mib"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return fields


def _table(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    table = config.get(name, {})
    if not isinstance(table, dict):
        raise Refused(f"its task.toml's {name} is not a table ([{name}])")
    return table


def _field(where: str, key: str, value: Any) -> str:
    return f"its task.toml's [{where}] {key} = {value!r}"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _seconds(table: Mapping[str, Any], where: str, key: str, maximum: float) -> float | None:
    value = table.get(key)
    if value is None:
        return None
    if not _number(value) or value <= 0:
        raise Refused(f"{_field(where, key, value)} is not a positive number of seconds")
    if value > maximum:
        raise Refused(f"{_field(where, key, value)} is over {maximum:g} s, the most a terminal task may set")
    return float(value)


def _whole(table: Mapping[str, Any], where: str, key: str, minimum: int) -> int | None:
    value = table.get(key)
    if value is None:
        return None
    if not _number(value) or not float(value).is_integer() or value < minimum:
        raise Refused(f"{_field(where, key, value)} is not a whole number of at least {minimum}")
    return int(value)


def size_mib(text: str) -> int:
    """Harbor's size strings ("4G", "512M", "1048576K"), in MiB as Harbor reads them; ValueError otherwise."""
    size = text.strip().upper()
    units = {"G": 1024.0, "M": 1.0, "K": 1 / 1024}
    if not size or size[-1] not in units:
        raise ValueError(text)
    amount = float(size[:-1])
    if not math.isfinite(amount) or amount <= 0:
        raise ValueError(text)
    return int(amount * units[size[-1]])


def _size(environment: Mapping[str, Any], new: str, old: str, minimum: int) -> int | None:
    """`new` (a number of MiB) or the older `old` ("4G"); both given, they must agree."""
    mib = _whole(environment, "environment", new, minimum)
    if old not in environment:
        return mib
    text = environment[old]
    try:
        parsed = size_mib(text) if isinstance(text, str) else -1
    except ValueError:
        parsed = -1
    if parsed < minimum:
        raise Refused(
            f'{_field("environment", old, text)} is not a size such as "4G" or "512M" of at least {minimum} MiB'
        )
    if mib is not None and mib != parsed:
        raise Refused(f"its task.toml's [environment] {old} = {text!r} and {new} = {mib} disagree")
    return parsed


def _unknown(table: Mapping[str, Any], where: str, known: frozenset[str]) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise Refused(
            f"its task.toml's [{where}] sets {', '.join(unknown)}, which this importer does not know "
            "(it could be a limit that would not be applied)"
        )


def _user(table: Mapping[str, Any], where: str, runs: str) -> None:
    user = table.get("user")
    if user is not None and user not in SANDBOX_USERS:
        raise Refused(
            f"{_field(where, 'user', user)}: it {runs} as that user, and here they run as the sandbox's "
            "user (agent, uid 1000)"
        )


def _cannot(environment: Mapping[str, Any], verifier: Mapping[str, Any]) -> None:
    """Refuse what the table asks that no sandbox here has."""
    gpus = _whole(environment, "environment", "gpus", 0)
    if gpus:
        raise Refused(f"{_field('environment', 'gpus', gpus)}: the sandboxes here have no GPU")
    if environment.get("tpu"):
        raise Refused("its task.toml's [environment] tpu asks for a TPU: the sandboxes here have none")
    system = environment.get("os", "linux")
    if not isinstance(system, str) or system.lower() != "linux":
        raise Refused(f"{_field('environment', 'os', system)}: the sandboxes here are Linux")
    if environment.get("mcp_servers"):
        raise Refused("its task.toml's [environment] mcp_servers gives the agent MCP servers, which are not run here")
    if environment.get("env"):
        raise Refused(
            "its task.toml's [environment] env takes variables from the host at run time, which are not passed here"
        )
    if environment.get("healthcheck"):
        raise Refused(
            "its task.toml's [environment] healthcheck waits for a service before the agent starts; "
            "none is started or checked here"
        )
    if verifier.get("env"):
        raise Refused("its task.toml's [verifier] env sets variables for the tests, which are not passed here")
    if verifier.get("environment"):
        raise Refused("its task.toml's [verifier] environment defines an environment of the tests' own; "
                      "here the tests run in the task's image")  # fmt: skip
    if verifier.get("collect"):
        raise Refused("its task.toml's [[verifier.collect]] runs hooks after the agent, which are not run here")
    mode = verifier.get("environment_mode")
    if mode is not None and mode not in ("shared", "separate"):
        raise Refused(f"{_field('verifier', 'environment_mode', mode)} is not 'shared' or 'separate'")
    _seconds(environment, "environment", "build_timeout_sec", math.inf)
    for key in ("skills_dir", "docker_image"):
        value = environment.get(key)
        if value is not None and not isinstance(value, str):
            raise Refused(f"{_field('environment', key, value)} is not a string")


def _network(environment: Mapping[str, Any], agent: Mapping[str, Any], verifier: Mapping[str, Any]) -> str | None:
    """The field that gives the agent or the tests network access ("[environment] allow_internet =
    true"), or None. A phase's own network_mode overrides the environment's, which overrides the
    older allow_internet; any allowed_hosts asks for the hosts it lists."""
    allow = environment.get("allow_internet")
    if allow is not None and not isinstance(allow, bool):
        raise Refused(f"{_field('environment', 'allow_internet', allow)} is not true or false")
    tables = {"environment": environment, "agent": agent, "verifier": verifier}
    for where, table in tables.items():
        mode = table.get("network_mode")
        if mode is not None and mode not in NETWORK_MODES:
            raise Refused(f"{_field(where, 'network_mode', mode)} is not one of {', '.join(NETWORK_MODES)}")
        hosts = table.get("allowed_hosts")
        if hosts is not None and (not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts)):
            raise Refused(f"{_field(where, 'allowed_hosts', hosts)} is not a list of host names")
        if hosts:
            return f"[{where}] allowed_hosts = {hosts!r}"
    for phase in ("agent", "verifier"):
        for where in (phase, "environment"):
            mode = tables[where].get("network_mode")
            if mode is not None:
                if mode != "no-network":
                    return f"[{where}] network_mode = {mode!r}"
                break
        else:
            if allow:
                return "[environment] allow_internet = true"
    return None


def read_limits(config: Mapping[str, Any], *, internet_ok: bool = False) -> TaskLimits:
    """A task.toml's limits, checked; Refused (saying which field and why) for a value that is
    unknown, malformed, or asks for what this server cannot give."""
    if config.get("steps"):
        raise Refused("it is a multi-step task ([[steps]]); only single-step tasks are imported")
    environment, agent, verifier = (_table(config, name) for name in ("environment", "agent", "verifier"))
    _unknown(environment, "environment", _ENVIRONMENT_KEYS)
    _unknown(agent, "agent", _AGENT_KEYS)
    _unknown(verifier, "verifier", _VERIFIER_KEYS)
    _cannot(environment, verifier)
    _user(agent, "agent", "runs the agent")
    _user(verifier, "verifier", "runs the tests")
    _seconds(agent, "agent", "setup_timeout_sec", math.inf)
    network = _network(environment, agent, verifier)
    if network is not None and not internet_ok:
        raise Refused(
            f"its task.toml gives it network access ({network}), and the sandboxes here have none: "
            "a task that needs it would run broken (--no-internet-ok imports it to run without)"
        )
    workdir = environment.get("workdir")
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
        raise Refused(f"{_field('environment', 'workdir', workdir)} is not an absolute path")
    verifier_timeout = _seconds(verifier, "verifier", "timeout_sec", MAX_VERIFIER_TIMEOUT_S)
    return TaskLimits(
        agent_timeout_s=_seconds(agent, "agent", "timeout_sec", MAX_AGENT_TIMEOUT_S) or 0.0,
        verifier_timeout_s=verifier_timeout or DEFAULT_VERIFIER_TIMEOUT_S,
        cpus=_whole(environment, "environment", "cpus", 1),
        memory_mib=_size(environment, "memory_mb", "memory", MIN_MEMORY_MIB),
        storage_mib=_size(environment, "storage_mb", "storage", 1),
        workdir=(workdir.rstrip("/") or "/") if workdir is not None else None,
    )
