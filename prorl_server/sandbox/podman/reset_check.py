"""The server's own proof that a reset sandbox holds nothing of its previous job.

The in-sandbox runtime does the reset (prorl_sandbox_runtime/reset.py `reset_runtime`) and says
what it left; a job's agent ran as the same uid as that runtime, so its word is
checked from the host wherever the host can see, against a snapshot taken when
the container was new, before any job ran in it:

- processes: every process in the container's PID namespace (listed by the
  container's own procfs, so `podman exec`'d ones too) must be the
  container's init or the runtime, both the very processes found at start;
- mounts: the container's mount table as its init sees it, unchanged;
- files: every writable mount (the tmpfs paths, /dev, /dev/shm, /dev/mqueue,
  Podman's /etc files), walked from the host through /proc/<init>/root
  without following a link: each entry's type, mode, owner, size, link
  count, device, link target, extended attributes and, for regular files,
  SHA-256 of the content, equal to the new container's. Content is hashed
  every time: a write through a shared mapping of a tmpfs file changes
  neither its mtime nor its ctime, so no time stamp can stand in for it;
- sockets: no TCP or UDP socket left in the container's network namespace;
- SysV IPC: no message queue, semaphore set or shared memory segment in
  its IPC namespace (read there by a thread that enters it with setns; the
  server must be root);
- the socket folder on the host: only the runtime's socket (the server
  removes anything else the job put there first).

Anything not observable counts as not proven: the sandbox is retired.
Every function here blocks (procfs, file reads): the provider runs them in
its threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import os
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from prorl_server.sandbox.blame import HostView, ProcessRef, process_ref

PROC = Path("/proc")
# File systems whose content is not files a job could leave behind (or is checked otherwise).
SKIPPED_FSTYPES = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devpts", "bpf", "debugfs", "securityfs"})
MAX_DIFFERENCES = 20


@dataclass(frozen=True)
class Entry:
    """What is compared of one file system entry (never its inode or time stamps)."""

    kind: str
    mode: int
    uid: int
    gid: int
    size: int
    nlink: int
    rdev: int
    link: str | None
    xattrs: tuple[tuple[str, bytes], ...]
    digest: str | None


@dataclass(frozen=True)
class Snapshot:
    mounts: tuple[str, ...]
    """The container's mount table as its init sees it (mount ids left out)."""
    trees: dict[str, dict[str, Entry]]
    """Writable mount point -> relative path -> entry."""


def _xattrs(path: str) -> tuple[tuple[str, bytes], ...]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return ()
    values = []
    for name in sorted(names):
        try:
            values.append((name, os.getxattr(path, name, follow_symlinks=False)))
        except OSError:
            values.append((name, b"?"))
    return tuple(values)


def _digest(path: str) -> str:
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(descriptor, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _entry(path: str, info: os.stat_result, *, content: bool) -> Entry:
    mode = info.st_mode
    kind = (
        "dir" if stat.S_ISDIR(mode) else
        "file" if stat.S_ISREG(mode) else
        "link" if stat.S_ISLNK(mode) else
        "other"
    )  # fmt: skip
    digest = None
    if kind == "file" and content:
        try:
            digest = _digest(path)
        except OSError as exc:
            digest = f"unreadable: {exc.strerror}"
    return Entry(
        kind=kind,
        mode=mode,
        uid=info.st_uid,
        gid=info.st_gid,
        size=info.st_size if kind != "dir" else 0,
        nlink=info.st_nlink if kind != "dir" else 0,
        rdev=info.st_rdev,
        link=os.readlink(path) if kind == "link" else None,
        xattrs=_xattrs(path),
        digest=digest,
    )


def walk_tree(top: str, *, content: bool = True) -> dict[str, Entry]:
    """Every entry under `top` (itself as "."), on its own file system only (a mount
    below it is its own tree), never following a link. `content=False` skips
    hashing (mqueue files read as status lines that change)."""
    entries: dict[str, Entry] = {}
    device = os.lstat(top).st_dev
    pending = [""]
    while pending:
        relative = pending.pop()
        path = os.path.join(top, relative) if relative else top
        info = os.lstat(path)
        if info.st_dev != device:  # another mount: named, not entered
            entries[relative or "."] = Entry("mountpoint", 0, 0, 0, 0, 0, 0, None, (), None)
            continue
        entries[relative or "."] = _entry(path, info, content=content)
        if stat.S_ISDIR(info.st_mode):
            pending += [os.path.join(relative, name) for name in os.listdir(path)]
    return entries


def _mount_table(pid: int) -> list[tuple[str, str, str, str]]:
    """(mount point, options, fstype, the rest) of each mount in `pid`'s table."""
    rows = []
    for line in (PROC / str(pid) / "mountinfo").read_text().splitlines():
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        fstype, _, rest = tail.partition(" ")
        # mount id, parent id, major:minor, root, mount point, options, optional fields
        rows.append((parts[4], parts[5], fstype, f"{parts[2]} {parts[3]} {rest}"))
    return rows


def read_only(pid: int, point: str) -> bool:
    """Whether the mount at `point` in `pid`'s table cannot be written (mount or superblock ro)."""
    for line in (PROC / str(pid) / "mountinfo").read_text().splitlines():
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        if parts[4] == point:
            super_options = tail.split()[2].split(",") if len(tail.split()) > 2 else []
            return "ro" in parts[5].split(",") or "ro" in super_options
    return False


def writable_mounts(pid: int, *, skip: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """(mount point, fstype) of the mounts a process of the container could write to."""
    found = []
    for point, options, fstype, _ in _mount_table(pid):
        below_skipped = any(point == other or point.startswith(other.rstrip("/") + "/") for other in skip)
        if "rw" in options.split(",") and fstype not in SKIPPED_FSTYPES and not below_skipped:
            found.append((point, fstype))
    return found


def snapshot(init_pid: int, *, skip: frozenset[str]) -> Snapshot:
    """The container's mounts and writable trees, seen from the host. Blocking."""
    root = str(PROC / str(init_pid) / "root")
    trees = {}
    for point, fstype in writable_mounts(init_pid, skip=skip):
        trees[point] = walk_tree(root + point, content=fstype != "mqueue")
    mounts = tuple(" ".join(row) for row in _mount_table(init_pid))
    return Snapshot(mounts=mounts, trees=trees)


def differences(pristine: Snapshot, now: Snapshot) -> list[str]:
    """What differs from the new container, at most MAX_DIFFERENCES lines; [] when nothing."""
    found: list[str] = []
    if pristine.mounts != now.mounts:
        found.append("the mount table changed")
    for point in sorted(set(pristine.trees) | set(now.trees)):
        before, after = pristine.trees.get(point), now.trees.get(point)
        if before is None or after is None:
            found.append(f"{point}: writable mount {'added' if before is None else 'gone'}")
            continue
        for relative in sorted(set(before) | set(after)):
            if before.get(relative) != after.get(relative):
                change = "added" if relative not in before else "gone" if relative not in after else "changed"
                found.append(f"{os.path.join(point, relative)}: {change}")
                if len(found) >= MAX_DIFFERENCES:
                    return found
    return found


def stray_processes(view: HostView) -> list[str]:
    """Processes of the container other than its init and runtime ("pid command"), from the
    container's own procfs (one per PID namespace: it lists exactly that namespace's
    processes, `podman exec`'d ones included), each told apart by its start time. Blocking."""
    expected = {view.init.start_time, view.runtime.start_time}
    if process_ref(view.init.pid) != view.init:
        return ["the container's init is gone"]
    procfs = PROC / str(view.init.pid) / "root" / "proc"
    strays = []
    for entry in os.listdir(procfs):
        if not entry.isdigit():
            continue
        try:
            start_time = int((procfs / entry / "stat").read_text().rsplit(")", 1)[1].split()[19])
            command = (procfs / entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if start_time in expected and entry in ("1", str(_namespace_pid(view.runtime))):
            continue
        strays.append(f"{entry} {command.strip()[:200]}")
    return strays


def _namespace_pid(ref: ProcessRef) -> int | None:
    """The pid a host process has in its own (innermost) PID namespace."""
    try:
        for line in (PROC / str(ref.pid) / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def inet_sockets(pid: int) -> list[str]:
    """TCP, UDP and raw sockets some process holds in the network namespace of `pid` (its
    loopback), as table lines."""
    lines = []
    for table in ("tcp", "tcp6", "udp", "udp6", "raw", "raw6"):
        try:
            rows = (PROC / str(pid) / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        # A socket no process holds any more (TIME_WAIT) has inode 0 and carries nothing.
        lines += [f"{table}: {row.strip()}" for row in rows if len(row.split()) > 9 and row.split()[9] != "0"]
    return lines


def clear_socket_dir(folder: Path, socket_name: str) -> None:
    """Remove what the job put in the sandbox's socket folder (on the host), all but the
    runtime's socket; never following a link. Call it with no process left in the sandbox."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        path = folder / name
        if name == socket_name and stat.S_ISSOCK(os.lstat(path).st_mode):
            continue
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def socket_dir_extras(folder: Path, socket_name: str) -> list[str]:
    """Entries of the sandbox's socket folder (on the host) other than the runtime's socket."""
    try:
        names = os.listdir(folder)
    except OSError as exc:
        return [f"socket folder unreadable: {exc.strerror}"]
    extras = [name for name in names if name != socket_name]
    if socket_name in names and not stat.S_ISSOCK(os.lstat(folder / socket_name).st_mode):
        extras.append(f"{socket_name} is no socket")
    return extras


CLONE_NEWIPC = 0x08000000
_IPC_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ipc-namespace")
"""One thread enters sandboxes' IPC namespaces (setns changes only the calling thread's)."""


def _read_sysv_in(init_pid: int) -> list[str] | None:
    """Enter the IPC namespace of `init_pid` in this thread, read its SysV tables, come back."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        own = os.open("/proc/thread-self/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            target = os.open(PROC / str(init_pid) / "ns" / "ipc", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if libc.setns(target, CLONE_NEWIPC) != 0:
                return None
        finally:
            os.close(target)
        try:
            lines = []
            for kind in ("msg", "sem", "shm"):
                rows = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
                lines += [f"{kind}: {row.strip()}" for row in rows if row.strip()]
            return lines
        finally:
            if libc.setns(own, CLONE_NEWIPC) != 0:  # never leave the thread in a sandbox's namespace
                raise OSError(ctypes.get_errno(), "cannot return to the server's IPC namespace")
    finally:
        os.close(own)


async def sysv_ipc(init_pid: int) -> list[str] | None:
    """The SysV IPC objects in the container's IPC namespace ("msg: <line>"), read there
    (setns in a thread of its own); None when they cannot be seen (the server is not root)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_IPC_THREAD, _read_sysv_in, init_pid)
