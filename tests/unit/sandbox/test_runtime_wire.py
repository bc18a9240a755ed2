"""The in-sandbox program's one frame codec and its words, shared by both ends, and the
program staged as a folder the way a sandbox gets it (no Podman)."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest

from prorl_server.errors import SandboxError
from prorl_server.sandbox import runtime as program
from prorl_server.sandbox.runtime import socket_relay
from prorl_server.sandbox.runtime.client import RuntimeClient
from prorl_server.sandbox.runtime.prorl_sandbox_runtime import wire
from prorl_server.sandbox.runtime.protocol import Op


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short folder for an AF_UNIX socket (a long path does not fit in sun_path)."""
    with tempfile.TemporaryDirectory(prefix="w", dir=os.environ.get("PRORL_TEST_STATE_DIR")) as folder:
        yield Path(folder)


def test_the_servers_operation_type_names_exactly_the_runtimes_operations() -> None:
    assert sorted(get_args(Op)) == sorted(wire.OPS)


def test_a_frame_is_an_8_byte_big_endian_length_and_the_json_both_ends_wrote_before() -> None:
    message = {"id": 7, "op": "bash", "command": "echo é"}
    frame = wire.encode_frame(message)
    assert frame[:8] == len(frame[8:]).to_bytes(8, "big")
    assert frame[8:] == json.dumps(message).encode()  # the spacing the runtime always sent
    assert wire.encode_frame(message, compact=True)[8:] == json.dumps(message, separators=(",", ":")).encode()
    assert wire.decode_body(frame[8:]) == message
    assert wire.frame_size(frame[:8], len(frame) - 8) == len(frame) - 8


def test_a_length_over_the_readers_limit_is_refused_before_any_body_is_read() -> None:
    header = wire.HEADER.pack(wire.MAX_RELAY + 1)
    with pytest.raises(wire.FrameTooLarge, match="relay frame of"):
        wire.frame_size(header, wire.MAX_RELAY, "relay frame")
    assert issubclass(wire.FrameTooLarge, ValueError)  # what the relay's read loop ends on


def test_the_runtimes_socket_reader_stops_at_its_limit() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(wire.HEADER.pack(wire.MAX_REQUEST + 1))
        with pytest.raises(wire.FrameTooLarge):
            wire.recv_frame(right)
        left.sendall(wire.encode_frame({"op": "health"}))
        assert wire.recv_frame(right) == {"op": "health"}
        left.close()
        assert wire.recv_frame(right) is None


async def test_the_runtime_client_breaks_off_at_an_answer_over_its_limit(socket_dir: Path) -> None:
    """A process that took the runtime's socket and announces an answer of 2**62 bytes: the call
    fails as a lost sandbox at once, instead of the server waiting to buffer the body."""
    path = str(socket_dir / "rt.sock")

    async def hostile(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        header = await reader.readexactly(wire.HEADER.size)
        await reader.readexactly(wire.frame_size(header, wire.MAX_REQUEST))
        writer.write(wire.HEADER.pack(1 << 62))
        await writer.drain()
        await reader.read()  # until the client hangs up
        writer.close()

    server = await asyncio.start_unix_server(hostile, path)
    try:
        client = RuntimeClient(path)
        await client.connect()
        try:
            with pytest.raises(SandboxError, match="broke the protocol: a runtime answer of") as caught:
                await client.call(wire.OP_HEALTH, {})
            assert caught.value.reason == "sandbox_lost"
        finally:
            await client.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_the_relay_reader_refuses_a_frame_over_its_limit() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(wire.HEADER.pack(socket_relay.MAX_FRAME + 1))
    with pytest.raises(ValueError, match="relay frame"):
        await socket_relay._read_frame(reader)


def test_staging_copies_the_package_beside_the_scripts_and_drops_what_is_no_longer_in_it(tmp_path: Path) -> None:
    target = tmp_path / "runtime"
    (target / "prorl_sandbox_runtime" / "__pycache__").mkdir(parents=True)
    (target / "prorl_sandbox_runtime" / "gone.py").write_text("raise SystemExit('an old module')\n")
    program.stage(target)
    staged = sorted(path.relative_to(target) for path in target.rglob("*") if path.is_file())
    assert staged == sorted(program.program_files())
    assert Path("prorl_sandbox_runtime/wire.py") in staged
    for relative in staged:
        assert (target / relative).read_bytes() == (program.RUNTIME_DIR / relative).read_bytes()
        assert (target / relative).stat().st_mode & 0o777 == 0o644


def test_the_judge_in_isolated_mode_runs_the_staged_package_not_one_earlier_on_sys_path(tmp_path: Path) -> None:
    """The judge starts under -I (no script folder on sys.path): its entry script must put its
    own folder first, so a `prorl_sandbox_runtime` where it runs (a repository's) is not used."""
    target = tmp_path / "program"
    program.stage(target, read_only=True)
    decoy = tmp_path / "repo" / "prorl_sandbox_runtime"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise SystemExit('the repository shadowed the package')\n")
    (decoy / "wire.py").write_text("raise SystemExit('the repository shadowed the codec')\n")
    try:
        probe = (
            "import runpy, sys; sys.path.insert(0, sys.argv[2]); sys.argv = [sys.argv[1]];"
            "runpy.run_path(sys.argv[0], run_name='probe');"
            "print(sorted(set(m.__file__ for n, m in sys.modules.items() if n.startswith('prorl_sandbox_runtime'))))"
        )
        result = subprocess.run(
            [sys.executable, "-I", "-B", "-c", probe, str(target / "prorl_judge.py"), str(decoy.parent)],
            cwd=decoy.parent,
            env={"PYTHONPATH": str(decoy.parent), "PATH": os.environ.get("PATH", "")},
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        loaded = [Path(name) for name in ast.literal_eval(result.stdout.strip())]
        assert target / "prorl_sandbox_runtime" / "wire.py" in loaded
        assert target / "prorl_sandbox_runtime" / "pytest_runner.py" in loaded  # the whole harness, at start
        assert all(path.parent.parent == target for path in loaded), loaded
        no_mode = subprocess.run(
            [sys.executable, "-I", "-B", str(target / "prorl_judge.py")],
            cwd=decoy.parent,
            capture_output=True,
            text=True,
            check=False,
        )
        assert no_mode.returncode == 2 and "judging harness" in no_mode.stderr
    finally:
        for folder in (target / "prorl_sandbox_runtime", target):
            folder.chmod(0o755)
