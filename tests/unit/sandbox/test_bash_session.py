"""The in-sandbox bash session's sentinels, read as the runtime reads them (no Podman)."""

from __future__ import annotations

import importlib
import shutil
import tempfile
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def runtime() -> ModuleType:
    return importlib.import_module("prorl_server.sandbox.runtime.prorl_sandbox_runtime.bash")


@pytest.fixture
def session(runtime: ModuleType) -> Iterator[Any]:
    with tempfile.TemporaryDirectory() as workdir:
        bash = runtime.BashSession(workdir)
        yield bash
        bash.close()
        shutil.rmtree(bash.scratch, ignore_errors=True)  # the runtime's is its sandbox's /tmp


def test_a_sentinel_that_arrives_after_its_wait_gave_up_is_not_the_next_commands_output(session: Any) -> None:
    session.start()
    # What a set-up or resync answered too late on a busy machine leaves on the terminal.
    late = session._token()
    session._write(f"printf '\\n{late} 0\\n'\n")
    result = session.run("echo up", 60, 4096)
    assert result["output"] == "up\n" and result["exit_code"] == 0
    assert session.run("printf 'no newline'", 60, 4096)["output"] == "no newline"


def test_output_that_only_looks_like_a_sentinel_is_kept(session: Any) -> None:
    result = session.run("echo __PRORL_x; echo '__PRORL_1_2__ text'", 60, 4096)
    assert result["output"] == "__PRORL_x\n__PRORL_1_2__ text\n"


def test_a_shell_that_never_reads_its_set_up_is_an_error(
    runtime: ModuleType, session: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "BASH_START_S", 0.0)
    with pytest.raises(RuntimeError, match="bash did not start"):
        session.start()
    assert session.pid is None
