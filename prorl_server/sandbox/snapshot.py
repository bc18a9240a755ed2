"""A sandbox's working state at a turn boundary, taken and put back through its own runtime.

What a snapshot holds: the files under a few roots (the family names them: the
runtime's workdir, the sandbox's temporary directory, a SWE repository's working
tree), as a tar archive made *inside* the sandbox by a short script run from its
bash session, plus that session's working directory and exported environment.
Only what can change after the image started is taken, never the image itself.

Nothing of it is ever interpreted on the host beyond a check of the archive: the
archive is made in one sandbox and unpacked in another sandbox of the same image,
so it can hold nothing its sandbox could not already see. The script stores
symbolic links as links (never their targets), leaves out devices, FIFOs and
sockets, refuses a file system over the size cap, and names members relative to
their root; the host refuses any archive that breaks those rules anyway (a policy
that swaps the sandbox's python3 can make the archive), and so does the
unpacking script in the fork.

What is not carried: processes (a server the agent started, a background job), the
Python tool's names, the shell's non-exported variables, functions, aliases and
options, files outside the roots (for a SWE repository, its `.git` directory: the
fork gets the image's, at the same base commit).
"""

from __future__ import annotations

import asyncio
import io
import json
import posixpath
import secrets
import shlex
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prorl_server.errors import ProrlError, SandboxError
from prorl_server.sandbox.runtime.client import RuntimeOpFailed
from prorl_server.sandbox.runtime.protocol import ListDirRequest
from prorl_server.sandbox.sandbox import Sandbox

NOT_CARRIED = (
    "running processes (servers, background jobs)",
    "the Python tool's names and imports",
    "the bash session's non-exported variables, functions, aliases, options and history",
    "files outside the carried paths",
)
SKIPPED_ENV = frozenset({"PWD", "OLDPWD", "SHLVL", "_", "PPID", "BASHPID", "RANDOM", "LINENO"})
"""Not restored: the shell's own bookkeeping."""
SNAPSHOT_TIMEOUT_S = 300.0
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
WRITE_PIECE_BYTES = 4 << 20


@dataclass(frozen=True)
class Root:
    """A directory whose files a snapshot carries, named by `key` inside the archive."""

    key: str
    """"work": the runtime's workdir; "tmp": $TMPDIR or /tmp; else the absolute `path`."""
    path: str = ""
    exclude: tuple[str, ...] = ()
    """Names directly under the root that are neither carried nor cleared (".git"); one ending
    in "-" is a prefix."""


RUNTIME_SCRATCH = ("prorl-bash-", "prorl-py-", ".prorl-fork-")
"""The runtime's own scratch folders in the temporary directory: never carried nor cleared."""
DEFAULT_ROOTS = (Root("work"), Root("tmp", exclude=RUNTIME_SCRATCH))


class SnapshotRefused(ProrlError):
    """The state at this boundary cannot be kept (too large, a hostile archive, no python3)."""


@dataclass(frozen=True)
class SandboxState:
    """One sandbox's working state at a turn boundary."""

    archive: bytes
    cwd: str
    """The bash session's directory, as "<root key>/<relative path>" when inside a root."""
    env: Mapping[str, str]
    paths: Mapping[str, str]
    """Root key -> the absolute path it had in the snapshot's sandbox."""
    skipped: Sequence[str] = field(default_factory=tuple)
    """Entries left out (devices, FIFOs, sockets), as archive names."""


_CAPTURE = r"""
import json, os, stat, sys, tarfile
args = json.loads(sys.argv[1])
def excluded(name, exclude):
    return name in exclude or any(name.startswith(p) for p in exclude if p.endswith("-"))
out, limit, total, skipped = args["out"], args["max_bytes"], 0, []
tar = tarfile.open(os.path.join(out, "files.tar"), "w", format=tarfile.PAX_FORMAT)
def add(name, path, info):
    global total
    t = tarfile.TarInfo(name)
    t.mode, t.mtime, t.uid, t.gid = stat.S_IMODE(info.st_mode), int(info.st_mtime), 0, 0
    if stat.S_ISLNK(info.st_mode):
        t.type, t.linkname = tarfile.SYMTYPE, os.readlink(path)
        tar.addfile(t)
    elif stat.S_ISDIR(info.st_mode):
        t.type = tarfile.DIRTYPE
        tar.addfile(t)
    elif stat.S_ISREG(info.st_mode):
        total += info.st_size
        if total > limit:
            sys.stderr.write("over %d bytes" % limit)
            sys.exit(3)
        t.size = info.st_size
        with open(path, "rb") as handle:
            tar.addfile(t, handle)
    else:
        skipped.append(name)
for key, root, exclude in args["roots"]:
    if not os.path.isdir(root) or os.path.islink(root):
        continue
    add(key, root, os.lstat(root))
    for here, dirs, files in os.walk(root):
        rel = os.path.relpath(here, root)
        if rel == ".":
            dirs[:] = [d for d in dirs if not excluded(d, exclude)]
            files = [f for f in files if not excluded(f, exclude)]
        for name in sorted(dirs) + sorted(files):
            path = os.path.join(here, name)
            if path == out or path.startswith(out + os.sep):
                continue
            member = key + "/" + os.path.normpath(os.path.join(rel, name))
            try:
                add(member, path, os.lstat(path))
            except OSError:
                skipped.append(member)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(here, d))]
tar.close()
with open(os.path.join(out, "state.json"), "w") as handle:
    json.dump({"cwd": os.getcwd(), "env": dict(os.environ), "skipped": skipped}, handle)
"""

_RESTORE = r"""
import json, os, shutil, stat, sys, tarfile
args = json.loads(sys.argv[1])
def excluded(name, exclude):
    return name in exclude or any(name.startswith(p) for p in exclude if p.endswith("-"))
roots = {key: (path, set(exclude)) for key, path, exclude in args["roots"]}
tar = tarfile.open(args["archive"])
members = tar.getmembers()
names = set()
for m in members:
    key = m.name.split("/", 1)[0]
    if key not in roots or ".." in m.name.split("/") or m.name.startswith("/"):
        sys.exit("bad member %r" % m.name)
    if not (m.isdir() or m.isreg() or m.issym()):
        sys.exit("bad member type %r" % m.name)
    names.add(m.name)
skip = os.path.dirname(args["archive"])
for key, (root, exclude) in roots.items():
    os.makedirs(root, exist_ok=True)
    for here, dirs, files in os.walk(root, topdown=False):
        rel = os.path.relpath(here, root)
        for name in files + dirs:
            path = os.path.join(here, name)
            if rel == "." and excluded(name, exclude) or path == skip or skip.startswith(path + os.sep):
                continue
            if key + "/" + os.path.normpath(os.path.join(rel, name)) in names:
                if not os.path.islink(path) and not os.path.isdir(path):
                    os.unlink(path)
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
dirs = []
for m in members:
    key, _, rel = m.name.partition("/")
    path = os.path.join(roots[key][0], rel) if rel else roots[key][0]
    if m.isdir():
        if os.path.islink(path):
            os.unlink(path)
        os.makedirs(path, exist_ok=True)
        dirs.append((path, m))
        continue
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    if m.issym():
        os.symlink(m.linkname, path)
        continue
    with tar.extractfile(m) as source, open(path, "wb") as target:
        shutil.copyfileobj(source, target)
    os.chmod(path, m.mode)
    os.utime(path, (m.mtime, m.mtime))
for path, m in reversed(dirs):
    try:  # a root the sandbox's user does not own (/tmp) keeps its own mode and time
        os.chmod(path, m.mode | stat.S_IWUSR | stat.S_IXUSR)
        os.utime(path, (m.mtime, m.mtime))
    except PermissionError:
        if m.name in roots:
            continue
        raise
with open(os.path.join(skip, "state.json"), "w") as handle:
    json.dump({"cwd": os.getcwd(), "env": dict(os.environ)}, handle)
"""


async def _paths(sandbox: Sandbox, roots: Sequence[Root]) -> dict[str, str]:
    """Each root's absolute path in this sandbox."""
    workdir = (await sandbox.runtime.list_dir(ListDirRequest("."))).path
    tmp = await _tmpdir(sandbox)
    paths: dict[str, str] = {}
    for root in roots:
        if root.key == "work":
            paths[root.key] = workdir
        elif root.key == "tmp":
            paths[root.key] = tmp
        else:
            paths[root.key] = root.path
    return paths


async def _tmpdir(sandbox: Sandbox) -> str:
    """The sandbox's temporary directory as its runtime started with it (TMPDIR, else /tmp): read
    from the runtime's own /proc/self/environ, which nothing the agent exports can change. Where
    that is not readable (Podman: the runtime is the container's init, whose environment sets no
    TMPDIR), /tmp."""
    try:
        environ = await sandbox.read_file("/proc/self/environ", max_bytes=1 << 20)
    except RuntimeOpFailed:  # not readable (the runtime as the container's init): its default
        return "/tmp"
    for entry in environ.split(b"\0"):
        if entry.startswith(b"TMPDIR="):
            return entry[len(b"TMPDIR=") :].decode(errors="replace") or "/tmp"
    return "/tmp"


async def _run_script(sandbox: Sandbox, script: str, args: Mapping[str, object], what: str) -> None:
    # A subshell: nothing it sets reaches the agent's session; /usr/bin/env with the image's own
    # PATH: no alias, function or python3 the agent put on its PATH stands in for the image's.
    command = (
        f"(/usr/bin/env PATH={SYSTEM_PATH} python3 -c {shlex.quote(script)} {shlex.quote(json.dumps(args))}) || false"
    )
    result = await sandbox.bash(command, timeout_s=SNAPSHOT_TIMEOUT_S)
    if result.exit_code != 0:
        raise SnapshotRefused(f"{what} failed in the sandbox (exit {result.exit_code}): {result.output[-500:]}")


async def capture(sandbox: Sandbox, roots: Sequence[Root], *, max_bytes: int) -> SandboxState:
    """The sandbox's files under `roots`, its shell's directory and environment, now."""
    if sandbox.mode != "runtime":
        raise SnapshotRefused("the sandbox's image has no python3 (exec mode): its state cannot be kept")
    paths = await _paths(sandbox, roots)
    out = posixpath.join(paths.get("tmp") or await _tmpdir(sandbox), f".prorl-fork-{secrets.token_hex(6)}")
    await sandbox.bash(f"(mkdir -m 700 -p {shlex.quote(out)})", timeout_s=60)
    try:
        args = {
            "out": out,
            "max_bytes": max_bytes,
            "roots": [[r.key, paths[r.key], list(r.exclude)] for r in roots],
        }
        await _run_script(sandbox, _CAPTURE, args, "the snapshot")
        archive = await sandbox.read_file(posixpath.join(out, "files.tar"), max_bytes=max_bytes + (16 << 20))
        state = json.loads(await sandbox.read_file(posixpath.join(out, "state.json"), max_bytes=16 << 20))
    finally:
        await sandbox.bash(f"(rm -rf {shlex.quote(out)})", timeout_s=60)
    await asyncio.to_thread(check_archive, archive, [r.key for r in roots], max_bytes)
    return SandboxState(
        archive=archive,
        cwd=_relative_cwd(str(state["cwd"]), paths),
        env={str(k): str(v) for k, v in state["env"].items()},
        paths=paths,
        skipped=tuple(state.get("skipped", ())),
    )


async def restore(sandbox: Sandbox, roots: Sequence[Root], state: SandboxState) -> None:
    """Make `sandbox`'s files under `roots` those of `state` (nothing more, nothing less), then
    put its shell in the state's directory with the state's environment."""
    if sandbox.mode != "runtime":
        raise SandboxError("the fork's sandbox has no python3: its state cannot be restored", reason="fork_restore")
    paths = await _paths(sandbox, roots)
    folder = posixpath.join(paths.get("tmp") or await _tmpdir(sandbox), f".prorl-fork-{secrets.token_hex(6)}")
    archive = posixpath.join(folder, "files.tar")
    await sandbox.bash(f"(mkdir -m 700 -p {shlex.quote(folder)})", timeout_s=60)
    try:
        # In pieces: one runtime file call is bounded in time, and a repository's tree is tens of MiB.
        pieces = [state.archive[i : i + WRITE_PIECE_BYTES] for i in range(0, len(state.archive), WRITE_PIECE_BYTES)]
        names = [posixpath.join(folder, f"piece-{index:05d}") for index in range(len(pieces))]
        for name, piece in zip(names, pieces, strict=True):
            await sandbox.write_file(name, piece)
        joined = " ".join(shlex.quote(name) for name in names)
        result = await sandbox.bash(f"(cat {joined} > {shlex.quote(archive)} && rm -f {joined})", timeout_s=300)
        if result.exit_code != 0:
            raise SandboxError(f"the snapshot could not be written: {result.output[-300:]}", reason="fork_restore")
        args = {"archive": archive, "roots": [[r.key, paths[r.key], list(r.exclude)] for r in roots]}
        try:
            await _run_script(sandbox, _RESTORE, args, "restoring the snapshot")
        except SnapshotRefused as exc:
            raise SandboxError(exc.message, reason="fork_restore") from None
        fresh = json.loads(await sandbox.read_file(posixpath.join(folder, "state.json"), max_bytes=16 << 20))
    finally:
        await sandbox.bash(f"(rm -rf {shlex.quote(folder)})", timeout_s=60)
    script = _shell_state(state, paths, {str(k): str(v) for k, v in fresh["env"].items()})
    result = await sandbox.bash(script, timeout_s=60)
    if result.exit_code != 0:
        raise SandboxError(f"restoring the shell's state failed: {result.output[-500:]}", reason="fork_restore")


def _relative_cwd(cwd: str, paths: Mapping[str, str]) -> str:
    """The directory as "<key>/<rel>" inside the longest root holding it, else as it is."""
    for key, root in sorted(paths.items(), key=lambda item: -len(item[1])):
        if cwd == root or cwd.startswith(root.rstrip("/") + "/"):
            rel = posixpath.relpath(cwd, root)
            return key if rel == "." else f"{key}/{rel}"
    return cwd


def _shell_state(state: SandboxState, paths: Mapping[str, str], fresh: Mapping[str, str]) -> str:
    """Bash that moves the fork's session to the parent's directory and environment. A value
    naming one of the parent's root paths names the fork's instead (they differ on hosts
    where each sandbox has its own folder)."""

    def moved(value: str) -> str:
        for key, old in state.paths.items():
            new = paths.get(key)
            if new and old != new:
                value = value.replace(old, new)
        return value

    lines: list[str] = []
    for name in sorted(set(fresh) - set(state.env) - SKIPPED_ENV):
        if name.isidentifier():
            lines.append(f"unset {name}")
    for name, value in sorted(state.env.items()):
        if name in SKIPPED_ENV or not name.isidentifier():
            continue
        value = moved(value)
        if fresh.get(name) != value:
            lines.append(f"export {name}={shlex.quote(value)}")
    key, _, rel = state.cwd.partition("/")
    cwd = posixpath.join(paths[key], rel) if key in paths else state.cwd
    lines.append(f"cd -- {shlex.quote(cwd.rstrip('/') or '/')}")
    return "\n".join(lines)


def check_archive(archive: bytes, keys: Sequence[str], max_bytes: int) -> None:
    """Refuse an archive that could carry anything out of the sandbox, or is too large:
    members only under the roots' keys, relative, without `..`; only directories, regular
    files and symbolic links (never hard links, devices, FIFOs); regular files within
    `max_bytes` in all. The host never unpacks it; this check is the host's own word on it."""
    if len(archive) > max_bytes + (16 << 20):
        raise SnapshotRefused(f"the snapshot is over the cap of {max_bytes} bytes")
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
            for member in tar:
                name = member.name
                parts = name.split("/")
                if name.startswith("/") or ".." in parts or parts[0] not in keys:
                    raise SnapshotRefused(f"the snapshot holds a member outside its paths: {name[:200]!r}")
                if not (member.isdir() or member.isreg() or member.issym()):
                    raise SnapshotRefused(f"the snapshot holds a member of a refused type: {name[:200]!r}")
                total += member.size if member.isreg() else 0
                if total > max_bytes:
                    raise SnapshotRefused(f"the snapshot is over the cap of {max_bytes} bytes")
    except tarfile.TarError as exc:
        raise SnapshotRefused(f"the snapshot is not a readable archive: {exc}") from None
