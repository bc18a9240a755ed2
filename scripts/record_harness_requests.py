"""Record the HTTP requests that real agent harnesses send to the model gateway, as test data.

Each harness (Codex CLI, Claude Code, Gemini CLI, OpenCode, Qwen Code) is run once, unmodified,
configured only as its own documentation says (a base URL, a key, a model name; telemetry and
update checks off), against a loopback ModelGateway over a scripted model: the first call of a
conversation that offers the harness's shell tool calls it (`echo prorl-recorded`), every other
call answers "Done.". Every request is written, in order, to
tests/data/harness_requests/<harness>-<version>/NN.json: method, path, headers (the key and
anything secret-like replaced by "<redacted>"), the JSON body, and the status the gateway gave.
tests/unit/gateway/test_harness_requests.py replays them in the fast suite, so a harness upgrade that
changes what it sends is caught by recording again:

    npm install --prefix DIR @openai/codex @anthropic-ai/claude-code @google/gemini-cli \\
        opencode-ai @qwen-code/qwen-code
    python scripts/record_harness_requests.py --npm DIR [HARNESS ...]

Each run gets a fresh HOME and working folder under the system's temporary folder, removed after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prorl_server.gateway.aiohttp_adapter import GatewayServer
from prorl_server.gateway.app import ModelGateway
from prorl_server.llm.base import ApiToolCall, ChatResult, Sampling
from prorl_server.sandbox.runtime.relay import HttpRequest, HttpResponse

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "harness_requests"
KEY = "sk-prorl-recording"
MODEL = "prorl"
PROMPT = "Run the shell command `echo prorl-recorded`, then answer with the single word: done."
SECRET_HEADERS = frozenset({"authorization", "x-api-key", "x-goog-api-key", "cookie", "proxy-authorization"})
MAX_REQUESTS = 8
"""Requests kept per harness (the first ones)."""

SHELL_CALLS: dict[str, dict[str, Any]] = {
    # The argument shape of each harness's shell tool, by its name.
    "exec_command": {"cmd": "echo prorl-recorded"},
    "shell": {"command": ["bash", "-lc", "echo prorl-recorded"]},
    "shell_command": {"command": "echo prorl-recorded"},
    "Bash": {"command": "echo prorl-recorded", "description": "Print a word"},
    "bash": {"command": "echo prorl-recorded", "description": "Print a word"},
    "run_shell_command": {"command": "echo prorl-recorded", "description": "Print a word"},
}


@dataclass
class Harness:
    name: str
    package: str
    binary: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    """Paths under HOME and their text ({base} and {key} filled in)."""


CODEX_CONFIG = """model = "prorl"
model_provider = "prorl"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[model_providers.prorl]
name = "prorl"
base_url = "{base}/v1"
env_key = "PRORL_GATEWAY_KEY"
wire_api = "responses"

[analytics]
enabled = false
"""
OPENCODE_CONFIG = {
    "$schema": "https://opencode.ai/config.json",
    "provider": {
        "prorl": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "prorl",
            "options": {"baseURL": "{base}/v1", "apiKey": "{key}"},
            "models": {"prorl": {"name": "prorl", "tool_call": True}},
        }
    },
    "model": "prorl/prorl",
    "autoupdate": False,
    "share": "disabled",
}
HARNESSES = {
    harness.name: harness
    for harness in [
        Harness(
            "codex",
            "@openai/codex",
            "codex",
            ["exec", "--skip-git-repo-check", PROMPT],
            env={"CODEX_HOME": "{home}/.codex", "PRORL_GATEWAY_KEY": "{key}"},
            files={".codex/config.toml": CODEX_CONFIG},
        ),
        Harness(
            "claude-code",
            "@anthropic-ai/claude-code",
            "claude",
            ["-p", PROMPT, "--allowedTools", "Bash"],
            env={
                "ANTHROPIC_BASE_URL": "{base}",
                "ANTHROPIC_API_KEY": "{key}",
                "DISABLE_TELEMETRY": "1",
                "DISABLE_AUTOUPDATER": "1",
                "DISABLE_ERROR_REPORTING": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            },
        ),
        Harness(
            "gemini-cli",
            "@google/gemini-cli",
            "gemini",
            ["-p", PROMPT, "--yolo"],
            env={
                "GOOGLE_GEMINI_BASE_URL": "{base}",
                "GEMINI_API_KEY": "{key}",
                "GEMINI_MODEL": "gemini-2.5-pro",
                "GEMINI_CLI_TRUST_WORKSPACE": "true",
            },
            files={
                ".gemini/settings.json": json.dumps(
                    {
                        "security": {"auth": {"selectedType": "gemini-api-key"}},
                        "telemetry": {"enabled": False},
                        "privacy": {"usageStatisticsEnabled": False},
                        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
                    }
                )
            },
        ),
        Harness(
            "opencode",
            "opencode-ai",
            "opencode",
            ["run", PROMPT],
            env={
                "OPENCODE_DISABLE_AUTOUPDATE": "1",
                "OPENCODE_DISABLE_MODELS_FETCH": "1",
                "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            },
            files={".config/opencode/opencode.json": json.dumps(OPENCODE_CONFIG)},
        ),
        Harness(
            "qwen-code",
            "@qwen-code/qwen-code",
            "qwen",
            ["-p", PROMPT, "--yolo"],
            env={"OPENAI_BASE_URL": "{base}/v1", "OPENAI_API_KEY": "{key}", "OPENAI_MODEL": MODEL},
            files={
                ".qwen/settings.json": json.dumps(
                    {
                        "security": {"auth": {"selectedType": "openai"}},
                        "telemetry": {"enabled": False},
                        "privacy": {"usageStatisticsEnabled": False},
                        "general": {"disableAutoUpdate": True},
                    }
                )
            },
        ),
    ]
}


async def scripted_model(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
) -> ChatResult:
    """Call the harness's shell tool once per conversation, then say "Done."."""
    offered = {tool["function"]["name"] for tool in tools}
    shell = next((name for name in SHELL_CALLS if name in offered), None)
    if shell is not None and not any(message.get("role") == "tool" for message in messages):
        call = ApiToolCall("call_prorl_1", shell, json.dumps(SHELL_CALLS[shell]))
        return ChatResult(
            text="", finish_reason="tool_calls", prompt_tokens=100, completion_tokens=10, tool_calls=(call,)
        )
    return ChatResult(text="Done.", finish_reason="stop", prompt_tokens=100, completion_tokens=2)


class Recorder:
    """A RelayHandler that keeps each request (and the status the gateway answered) in order."""

    def __init__(self, gateway: ModelGateway) -> None:
        self.gateway = gateway
        self.requests: list[dict[str, Any]] = []

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        body: Any = None
        if request.body:
            try:
                body = json.loads(request.body)
            except ValueError:
                body = request.body.decode("utf-8", "replace")
        headers = {
            name: ("<redacted>" if name in SECRET_HEADERS or KEY in value else value)
            for name, value in sorted(request.headers.items())
        }
        entry: dict[str, Any] = {"method": request.method, "path": request.path, "headers": headers, "body": body}
        self.requests.append(entry)
        response = await self.gateway(request)
        entry["status"] = response.status
        return response


async def version_of(binary: Path) -> str:
    process = await asyncio.create_subprocess_exec(
        str(binary), "--version", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await process.communicate()
    words = [word.strip("v(),") for word in out.decode().split()]
    return next((word for word in words if word[:1].isdigit() and "." in word), "unknown")


async def record(harness: Harness, npm: Path, timeout_s: float) -> Path:
    binary = npm / "node_modules" / ".bin" / harness.binary
    version = await version_of(binary)
    recorder = Recorder(
        ModelGateway(
            scripted_model, default_sampling=Sampling(max_tokens=1024, temperature=1.0), model=MODEL, api_key=KEY
        )
    )
    server = GatewayServer(recorder)
    await server.start()
    scratch = Path(tempfile.mkdtemp(prefix="prorl-record-"))
    try:
        home, work = scratch / "home", scratch / "work"
        work.mkdir(parents=True)
        fill = {"base": server.url, "key": KEY, "home": str(home)}
        for relative, text in harness.files.items():
            path = home / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text.replace("{base}", fill["base"]).replace("{key}", KEY))
        env = {
            "PATH": f"{binary.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": str(home),
            "TERM": "dumb",
            "CI": "1",
            "NO_COLOR": "1",
            **{name: value.format(**fill) for name, value in harness.env.items()},
        }
        process = await asyncio.create_subprocess_exec(
            str(binary),
            *harness.argv,
            cwd=work,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = await asyncio.wait_for(process.communicate(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            out, _ = await process.communicate()
        print(f"--- {harness.name} {version}: exit {process.returncode}\n{out.decode(errors='replace')[-3000:]}")
    finally:
        await server.close()
        shutil.rmtree(scratch, ignore_errors=True)
    folder = OUT / f"{harness.name}-{version}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    distinct: list[dict[str, Any]] = []  # a retry of the same request is kept once
    for entry in recorder.requests:
        if not any({**entry, "headers": {}} == {**other, "headers": {}} for other in distinct):
            distinct.append(entry)
    kept = distinct[:MAX_REQUESTS]
    for index, entry in enumerate(kept):
        entry = {"harness": harness.name, "package": harness.package, "version": version, **entry}
        text = json.dumps(entry, indent=1, ensure_ascii=False).replace(f"127.0.0.1:{server.port}", "127.0.0.1:PORT")
        (folder / f"{index:02d}.json").write_text(text + "\n")
    statuses = [entry.get("status") for entry in kept]
    print(f"{harness.name} {version}: {len(recorder.requests)} requests, kept {len(kept)}, statuses {statuses}")
    return folder


async def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--npm", type=Path, required=True, help="the --prefix the CLIs were installed under")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per harness run")
    parser.add_argument("harnesses", nargs="*", default=list(HARNESSES), choices=list(HARNESSES))
    args = parser.parse_args(argv)
    for name in args.harnesses:
        await record(HARNESSES[name], args.npm, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
