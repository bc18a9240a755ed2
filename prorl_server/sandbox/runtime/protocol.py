"""What can be asked of a sandbox runtime: one request and one response type per operation.

A leaf module (it imports only the operation names both ends of the wire share,
prorl_sandbox_runtime/wire.py): the runtimes
(sandbox/runtime/socket_runtime.py, sandbox/podman/exec_runtime.py), the
`Sandbox` the agents use and the test fakes all speak these types. They are
transport-neutral: how a request travels (JSON frames to prorl_runtime.py, a
`podman exec`) is each runtime's business. Field names follow the in-sandbox
runtime's wire format where there is one, so the mapping stays obvious.

Every request class names its operation in `op`, the discriminator the wire
format also uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from prorl_server.sandbox.runtime.prorl_sandbox_runtime import wire

Op = Literal["bash", "python", "edit", "read_file", "write_file", "list_dir", "health", "judge", "reset"]
"""wire.OPS, as a type (tests/unit/sandbox/test_runtime_wire.py keeps the two equal)."""


# --- results the agents see --------------------------------------------------------------


@dataclass(frozen=True)
class CommandResult:
    """How a command (bash, python, an editor command) ended."""

    output: str
    exit_code: int | None = None
    truncated: bool = False
    """The output was capped: its head and tail are kept, the cut is marked in the text."""
    timed_out: bool = False
    duration_s: float = 0.0
    is_error: bool = False
    """Python raised, or the editor refused: the output says why."""


@dataclass(frozen=True)
class JudgeResult:
    """How a run of the judging harness (runtime/prorl_judge.py) ended."""

    verdict: dict[str, Any] | None
    """What the harness wrote on its verdict pipe; None when it gave none (killed,
    crashed, timed out): the judged code cannot write here, only prevent it."""
    problem: str = ""
    """Why there is no verdict."""
    output: str = ""
    """The harness's log, with what the judged code printed: for humans, never judged."""
    exit_code: int | None = None
    timed_out: bool = False
    duration_s: float = 0.0


# --- requests ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BashRequest:
    op: ClassVar[Op] = wire.OP_BASH
    command: str
    """Run in the sandbox's shell; cwd, environment and background jobs persist where the runtime allows."""
    timeout_s: float
    """A command still running after this is interrupted, then killed with its process group."""


@dataclass(frozen=True)
class PythonRequest:
    op: ClassVar[Op] = wire.OP_PYTHON
    code: str
    """Executed in one persistent namespace where the runtime allows (names survive between calls)."""
    timeout_s: float


@dataclass(frozen=True)
class EditRequest:
    """A str_replace-style editor command; a field left None is not sent."""

    op: ClassVar[Op] = wire.OP_EDIT
    command: str
    """view, create, str_replace, insert or undo; the runtime tells the agent when it is none of these."""
    path: str
    file_text: str | None = None
    """create: the whole content of the new file."""
    old_str: str | None = None
    """str_replace: the exact text to replace."""
    new_str: str | None = None
    """str_replace and insert: the new text."""
    insert_line: int | None = None
    """insert: the line after which to insert (0: the top)."""
    view_range: list[int] | None = None
    """view: [first, last] lines; -1 as last means the end of the file."""

    def arguments(self) -> dict[str, Any]:
        """The optional fields that were given (the editor tells "absent" apart from "empty")."""
        given = {
            "file_text": self.file_text,
            "old_str": self.old_str,
            "new_str": self.new_str,
            "insert_line": self.insert_line,
            "view_range": self.view_range,
        }
        return {name: value for name, value in given.items() if value is not None}


@dataclass(frozen=True)
class ReadFileRequest:
    op: ClassVar[Op] = wire.OP_READ_FILE
    path: str
    max_bytes: int | None = None
    """Read at most this many bytes; None: the whole file."""


@dataclass(frozen=True)
class WriteFileRequest:
    op: ClassVar[Op] = wire.OP_WRITE_FILE
    path: str
    data: bytes
    mode: int | None = None
    """Permission bits to set after writing; None: leave them as created."""


@dataclass(frozen=True)
class ListDirRequest:
    op: ClassVar[Op] = wire.OP_LIST_DIR
    path: str


@dataclass(frozen=True)
class HealthRequest:
    op: ClassVar[Op] = wire.OP_HEALTH


@dataclass(frozen=True)
class JudgeRequest:
    op: ClassVar[Op] = wire.OP_JUDGE
    mode: str
    """"function", "stdio" or "swe" (see prorl_judge.py)."""
    spec: Mapping[str, Any]
    """The task for the harness, JSON-serialisable."""
    timeout_s: float
    """The harness is killed with everything it started after this."""


@dataclass(frozen=True)
class ResetPath:
    """One writable path a reset empties and refills."""

    path: str
    """A mount point in the sandbox (a tmpfs)."""
    lower: str | None
    """The image's read-only copy of its content; None: it is left empty."""
    mode: int
    """The permission bits (and sticky bit) its top gets back."""


@dataclass(frozen=True)
class ResetRequest:
    """End every process but the sandbox's init and runtime, remove IPC objects and keys,
    restore `paths`, start the shell, Python and the editor afresh
    (prorl_sandbox_runtime/reset.py `reset_runtime`)."""

    op: ClassVar[Op] = wire.OP_RESET
    paths: tuple[ResetPath, ...]
    timeout_s: float


# --- responses ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BashResponse(CommandResult):
    pass


@dataclass(frozen=True)
class PythonResponse(CommandResult):
    state_lost: bool = False
    """The Python process was killed: names defined so far are gone."""


@dataclass(frozen=True)
class EditResponse(CommandResult):
    pass


@dataclass(frozen=True)
class ReadFileResponse:
    content: bytes
    truncated: bool = False
    """The file is longer than the request's max_bytes."""


@dataclass(frozen=True)
class WriteFileResponse:
    path: str
    """Where the file was written (relative paths resolved against the sandbox's workdir)."""


@dataclass(frozen=True)
class DirEntry:
    name: str
    type: Literal["file", "dir"]
    size: int

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "size": self.size}


@dataclass(frozen=True)
class ListDirResponse:
    path: str
    entries: list[DirEntry] = field(default_factory=list)
    """Sorted by name."""


@dataclass(frozen=True)
class HealthResponse:
    ok: bool = True
    pid: int | None = None
    """The runtime's pid inside the sandbox (None where there is no runtime)."""
    python: str | None = None
    """The sandbox's python3 version serving the runtime."""
    uptime_s: float | None = None


@dataclass(frozen=True)
class JudgeResponse:
    """What the runtime reports of a harness run; `judge_result` (sandbox/sandbox.py) reads it."""

    output: str = ""
    """The harness's log (capped), with what the judged code printed."""
    exit_code: int | None = None
    timed_out: bool = False
    verdict: str | None = None
    """The text the harness wrote on its verdict pipe, unparsed; None when it wrote nothing."""
    verdict_truncated: bool = False
    truncated: bool = False
    duration_s: float = 0.0


@dataclass(frozen=True)
class ResetResponse:
    """What the runtime reports left after a reset: all empty when it did its part. The
    server does not take its word alone (sandbox/podman/reset_check.py)."""

    processes: list[int] = field(default_factory=list)
    """Pids other than init and the runtime still there."""
    ipc: list[str] = field(default_factory=list)
    """SysV IPC objects still there ("msg:3")."""
    keys: list[str] = field(default_factory=list)
    """Lines of /proc/keys other than the user's empty keyrings."""
    failed: dict[str, str] = field(default_factory=dict)
    """Paths it could not restore, with why."""

    @property
    def clean(self) -> bool:
        return not (self.processes or self.ipc or self.keys or self.failed)
