"""A sandbox provider without Podman: each sandbox is a temporary folder on this host
served by the REAL in-sandbox runtime (prorl_server/sandbox/runtime/prorl_runtime.py and
its package, staged read-only into the sandbox's folder as the Podman provider stages them)
in a local process, wrapped in the same `Sandbox` class the Podman provider returns.

What is real: the runtime and its wire protocol (bash on a pty, persistent Python,
the editor, files, the judging harness beside it), the SocketRuntime client and its
blame path (with a NullInspector: nothing is blamed on the agent), the Sandbox
lifecycle (close callbacks, idempotent close).

What is not: isolation. Commands run as the test's user on the host, in the
sandbox's workdir (`<tmp>/work`); absolute paths are host paths, so tests should
use relative paths or `container.workdir`. The spec's cpus, memory and pids are
recorded, not enforced; there is no network isolation either.

Tasks that name absolute paths (a SWE instance's `repo_dir`) need the same path in
every sandbox: with `fixed_workdir=True` each sandbox's workdir is the provider's
one `workdir`, filled afresh for each new sandbox with a copy of the image's files
(made once by its setup, so a git repository has the same commits in each). A new
sandbox takes that path over from the previous one, whose files it replaces: fine for
a job's sandboxes, which are used one after the other (the SWE agent's, then the
judge's), wrong for jobs running side by side.

Reset (ContainerHandle.reset, for reuse) goes through the real runtime's `reset` op:
as a child subreaper outside a sandbox's own PID namespace it kills only its own
descendants and restores the sandbox's workdir (from the image's files) and its
TMPDIR; the fake then checks, as the Podman provider does from the host, that no
process is left under the runtime and that both trees equal the new sandbox's. It
leaves IPC objects and keys alone (they would be the host's).

Removal leaves nothing behind: the runtime is started as a child subreaper, so
whatever it or the agent starts (even processes that leave their session or
their parent) stays in its process tree; removal stops that whole tree, kills
it, and deletes the folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from prorl_server.errors import SandboxError
from prorl_server.sandbox import runtime as program
from prorl_server.sandbox.base import (
    LABEL_MANAGED,
    LABEL_SERVER,
    ContainerHandle,
    Sandbox,
    SandboxProvider,
    SandboxSpec,
)
from prorl_server.sandbox.blame import NullInspector
from prorl_server.sandbox.podman.reset_check import Entry, walk_tree
from prorl_server.sandbox.runtime import RUNTIME_FILE
from prorl_server.sandbox.runtime.abstract import SandboxRuntime
from prorl_server.sandbox.runtime.client import RuntimeClient
from prorl_server.sandbox.runtime.protocol import ResetPath, ResetRequest
from prorl_server.sandbox.runtime.socket_runtime import SocketRuntime

ImageSetup = Callable[[Path], None]
"""Lays out a fake image's files in a new sandbox's workdir (e.g. a git repository)."""

PR_SET_CHILD_SUBREAPER = 36
# Makes the process a child subreaper (kept across exec), then becomes the runtime:
# orphans of anything started inside are re-parented to the runtime, not to the host's init.
BOOTSTRAP = (
    "import ctypes, os, sys\n"
    f"ctypes.CDLL(None, use_errno=True).prctl({PR_SET_CHILD_SUBREAPER}, 1, 0, 0, 0)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
)


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc (a snapshot)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(parent, []).append(int(entry))
    return tree


def _descendants(root: int) -> set[int]:
    tree, found, todo = _children(), set(), [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_tree(root: int) -> None:
    """SIGKILL `root` and all its descendants. Stopped first, so that none can fork or
    be re-parented away while the tree is walked. Blocking (reads /proc)."""
    _signal(root, signal.SIGSTOP)
    stopped: set[int] = set()
    quiet = 0
    while quiet < 2:  # twice nothing new: a fork under way when its parent stopped has shown up
        fresh = _descendants(root) - stopped
        for pid in fresh:
            _signal(pid, signal.SIGSTOP)
        stopped |= fresh
        quiet = 0 if fresh else quiet + 1
        time.sleep(0.001)
    for pid in (root, *stopped):
        _signal(pid, signal.SIGKILL)


def _make_writable(folder: Path) -> None:
    """Give a read-only staged program's folders back their write bit, so they can be removed."""
    for path in (folder / program.PACKAGE_DIR.name, folder):
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o755)


class FakeContainer(ContainerHandle):
    """A local runtime process and its folder: `<folder>/rt.sock`, `<folder>/work`,
    `<folder>/tmp`, its TMPDIR, and `<folder>/program`, the in-sandbox program (read-only)."""

    def __init__(
        self, provider: FakeSandboxProvider, name: str, folder: Path, spec: SandboxSpec, workdir: Path | None = None
    ) -> None:
        self._provider = provider
        self.name = name
        self.folder = folder
        self.spec = spec
        self._workdir = workdir
        self.labels = {LABEL_MANAGED: "1", LABEL_SERVER: provider.instance_id, **spec.labels}
        self.process: asyncio.subprocess.Process | None = None
        self.pristine: dict[str, dict[str, Entry]] | None = None
        """The writable trees when new (what a reset must bring back)."""
        self._removal: asyncio.Task[None] | None = None

    @property
    def id(self) -> str:
        return self.name

    @property
    def workdir(self) -> Path:
        """`<folder>/work`, or the provider's fixed workdir (FakeSandboxProvider(fixed_workdir=True))."""
        return self._workdir or self.folder / "work"

    @property
    def lower(self) -> Path:
        """A copy of the image's files, as the sandbox started with them (a reset restores them)."""
        return self.folder / "image"

    @property
    def socket_path(self) -> Path:
        return self.folder / "rt.sock"

    @property
    def program(self) -> Path:
        """The in-sandbox program's folder (the two entry scripts and their package)."""
        return self.folder / "program"

    @property
    def log_path(self) -> Path:
        return self.folder / "runtime.log"

    async def start(self, python: str, timeout_s: float) -> None:
        """Start the runtime and wait until its socket accepts."""
        scratch = self.folder / "tmp"  # the runtime's scratch files and the agent's TMPDIR
        scratch.mkdir(exist_ok=True)
        await asyncio.to_thread(program.stage, self.program, read_only=True)
        with self.log_path.open("wb") as log:
            self.process = await asyncio.create_subprocess_exec(
                python, "-c", BOOTSTRAP, str(self.program / RUNTIME_FILE.name), "serve",
                "--socket", str(self.socket_path), "--workdir", str(self.workdir),
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                cwd=self.workdir, env={**os.environ, "TMPDIR": str(scratch)}, start_new_session=True,
            )  # fmt: skip
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.socket_path.exists():
            if self.process.returncode is not None:
                raise SandboxError(
                    f"the fake sandbox's runtime exited at start (code {self.process.returncode}): {self._log_tail()}",
                    reason="sandbox_start",
                )
            if loop.time() > deadline:
                raise SandboxError(
                    f"the fake sandbox's runtime did not start within {timeout_s:g}s", reason="sandbox_start"
                )
            await asyncio.sleep(0.005)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_bytes()[-1500:].decode(errors="replace").strip()
        except OSError:
            return ""

    async def remove(self) -> None:
        # One removal, however many callers (close, provider.close, a failed create) ask for it.
        if self._removal is None:
            self._removal = asyncio.ensure_future(self._remove())
        await asyncio.shield(self._removal)

    async def _remove(self) -> None:
        try:
            process = self.process
            if process is not None:
                if process.returncode is None:
                    await asyncio.to_thread(kill_tree, process.pid)
                await process.wait()
            await asyncio.to_thread(_make_writable, self.program)
            await asyncio.to_thread(shutil.rmtree, self.folder, ignore_errors=True)
            if self._provider.holds_fixed_workdir(self):
                await asyncio.to_thread(shutil.rmtree, self.workdir, ignore_errors=True)
        finally:
            self._provider.forget(self)

    async def describe(self) -> str:
        process = self.process
        if process is None:
            state = "not started"
        elif process.returncode is None:
            state = f"pid={process.pid} running"
        else:
            state = f"pid={process.pid} exited with {process.returncode}"
        return f"fake sandbox {self.name}: {state}; {self._log_tail()}"

    async def limits_hit(self) -> list[str]:
        return []

    def trees(self) -> dict[str, dict[str, Entry]]:
        """The sandbox's writable trees as reset_check sees them. Blocking."""
        return {str(path): walk_tree(str(path)) for path in (self.workdir, self.folder / "tmp")}

    async def reset(self, runtime: SandboxRuntime) -> list[str]:
        if self.pristine is None or self.process is None or self._provider.fixed:
            return ["this fake sandbox cannot be reset"]
        lower = str(self.lower) if self.lower.exists() else None
        modes = {top: self.pristine[top]["."].mode & 0o7777 for top in self.pristine}
        paths = (
            ResetPath(str(self.workdir), lower, modes[str(self.workdir)]),
            ResetPath(str(self.folder / "tmp"), None, modes[str(self.folder / "tmp")]),
        )
        reply = await runtime.reset(ResetRequest(paths, 30.0))
        problems = [f"process left: {pid}" for pid in reply.processes]
        problems += [f"{path} not restored: {why}" for path, why in reply.failed.items()]
        assert self.process is not None
        left = await asyncio.to_thread(_descendants, self.process.pid)
        problems += [f"process left: {pid}" for pid in sorted(left)]
        now = await asyncio.to_thread(self.trees)
        for top in sorted(self.pristine):
            before, after = self.pristine[top], now.get(top, {})
            problems += [
                f"{top}/{relative}: changed" for relative in sorted(set(before) | set(after))
                if before.get(relative) != after.get(relative)
            ]  # fmt: skip
        return problems

    def __repr__(self) -> str:
        return f"FakeContainer({self.name!r}, image={self.spec.image!r})"


class FakeSandboxProvider(SandboxProvider):
    """Sandboxes on this host, for tests that need no isolation.

    `images`: None accepts any image; a mapping accepts only its images, and calls the
    image's setup (when not None) with the new sandbox's workdir before the runtime
    starts. An unknown image fails as an unbuilt one does (reason sandbox_image).

    `fixed_workdir`: every sandbox works in the same folder, `workdir`, which each new
    sandbox gets afresh with a copy of its image's files (`image_files`); see the module's
    docstring. The provider's folders are under `root` (default: the system's temp dir)
    and all gone after `close`.
    """

    def __init__(
        self,
        *,
        images: Mapping[str, ImageSetup | None] | None = None,
        instance_id: str = "fake",
        max_output_bytes: int = 16 * 1024,
        python: str = sys.executable,
        root: Path | None = None,
        start_timeout_s: float = 10.0,
        fixed_workdir: bool = False,
    ) -> None:
        self.instance_id = instance_id
        self._images = images
        self._max_output_bytes = max_output_bytes
        self._python = python
        self._root = root
        self._start_timeout_s = start_timeout_s
        self._live: dict[str, FakeContainer] = {}
        self._started = False
        self._fixed = fixed_workdir
        self._home: Path | None = None
        """fixed_workdir: the provider's own folder (`workdir`, and the images' files under images/)."""
        self._workdir_holder = ""
        self._workdir_lock = asyncio.Lock()
        self.created: list[SandboxSpec] = []
        """Every spec a sandbox was created for, in order (images and labels as asked)."""

    @property
    def busy(self) -> int:
        return len(self._live)

    @property
    def containers(self) -> list[FakeContainer]:
        """The sandboxes not yet removed."""
        return list(self._live.values())

    @property
    def workdir(self) -> Path:
        """The one workdir of every sandbox (fixed_workdir=True only): e.g. `workdir / "repo"` as
        a SWE instance's repo_dir."""
        if not self._fixed:
            raise RuntimeError("each sandbox has its own workdir: FakeSandboxProvider(fixed_workdir=True) has one")
        if self._home is None:
            self._home = Path(tempfile.mkdtemp(prefix=f"prorl-{self.instance_id}-", dir=self._root))
        return self._home / "workdir"

    def image_files(self, image: str) -> Path:
        """The files a sandbox of `image` starts with (fixed_workdir=True only): made by the image's
        setup on first use, and copied into `workdir` for each new sandbox. Blocking."""
        folder = self.workdir.parent / "images" / image.replace("/", "_").replace(":", "_")
        if not folder.exists():
            setup = self._images.get(image) if self._images is not None else None
            scratch = folder.with_name(folder.name + ".new")
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            if setup is not None:
                setup(scratch)
            scratch.rename(folder)
        return folder

    def holds_fixed_workdir(self, container: FakeContainer) -> bool:
        """Whether `container` is the sandbox working in the fixed workdir now."""
        return self._fixed and self._workdir_holder == container.name

    def _take_workdir(self, container: FakeContainer) -> None:
        """Give the fixed workdir to `container`, filled with a fresh copy of its image's files."""
        files = self.image_files(container.spec.image)
        shutil.rmtree(self.workdir, ignore_errors=True)
        shutil.copytree(files, self.workdir, symlinks=True)
        self._workdir_holder = container.name

    async def start(self) -> None:
        self._started = True

    async def create(self, spec: SandboxSpec) -> Sandbox:
        if not self._started:
            raise SandboxError("sandbox provider not started")
        if self._images is not None and spec.image not in self._images:
            raise SandboxError(
                f"sandbox image {spec.image!r} is not on this node: `make images` builds the project's own, "
                "others are pulled beforehand (docs/handlers.md)",
                reason="sandbox_image",
            )
        setup = self._images.get(spec.image) if self._images is not None else None
        self.created.append(spec)
        name = f"prorl-{self.instance_id}-{secrets.token_hex(6)}"
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self._root))
        container = FakeContainer(self, name, folder, spec, self.workdir if self._fixed else None)
        self._live[name] = container
        try:
            if self._fixed:
                async with self._workdir_lock:
                    await asyncio.to_thread(self._take_workdir, container)
            else:
                container.workdir.mkdir()
                if setup is not None:
                    await asyncio.to_thread(setup, container.workdir)
                    # The image's files as the sandbox got them: what a reset restores.
                    await asyncio.to_thread(shutil.copytree, container.workdir, container.lower, symlinks=True)
            await container.start(self._python, self._start_timeout_s)
            client = await RuntimeClient.open(str(container.socket_path))
        except BaseException:
            await container.remove()
            raise
        runtime = SocketRuntime(client, max_output_bytes=self._max_output_bytes, inspector=NullInspector(container))
        if not self._fixed:
            container.pristine = await asyncio.to_thread(container.trees)
        return Sandbox(runtime, container)

    @property
    def fixed(self) -> bool:
        return self._fixed

    def forget(self, container: FakeContainer) -> None:
        self._live.pop(container.name, None)

    async def close(self) -> None:
        for container in list(self._live.values()):
            await container.remove()
        self._started = False
        if self._home is not None:
            await asyncio.to_thread(shutil.rmtree, self._home, ignore_errors=True)
            self._home = None
