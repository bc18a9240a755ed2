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

A root that starts as the image's files (`Root.pristine`: a SWE repository's
working tree, the same in every fresh sandbox of the image) is carried as its
changes only. When the job starts, before its first turn (and in a fork, before the
restore), `record_base` lists the root's entries with their inode, type, mode, size,
mtime and ctime, in the sandbox's own scratch folder; a snapshot then carries the
entries whose stat differs from that listing or that it lacks (changed, added,
renamed: any change to an inode sets its ctime to the clock's time, and utime sets
only atime and mtime)
and names in a `.deleted` member the listed entries that are gone. The stat, not
git, says what changed: git's view rests on the index, HEAD and exclude files the
agent can change (a commit, a stash, `update-index --assume-unchanged`), and it
skips ignored files, which can matter (a compiled extension rebuilt in place).
Restoring applies the changes to the fork's fresh sandbox, whose root is the image's
again. Without a listing (the agent removed it) the snapshot falls back to the
whole tree. Other roots (the runtime's workdir, the temporary directory) are
carried whole: a fresh sandbox's hold next to nothing of the image's.

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
DELETED = ".deleted"
"""The archive member naming a pristine root's entries that are gone (NUL-separated member
names); no root's key starts with "."."""


@dataclass(frozen=True)
class Root:
    """A directory whose files a snapshot carries, named by `key` inside the archive."""

    key: str
    """"work": the runtime's workdir; "tmp": $TMPDIR or /tmp; else the absolute `path`."""
    path: str = ""
    exclude: tuple[str, ...] = ()
    """Names directly under the root that are neither carried nor cleared (".git"); one ending
    in "-" is a prefix."""
    pristine: bool = False
    """The root starts as the image's files, the same in every fresh sandbox of the image (a SWE
    repository's working tree): a snapshot carries only its changes since the job started."""

    def __post_init__(self) -> None:
        if not self.key or self.key.startswith(".") or "/" in self.key:
            raise ValueError(f"a snapshot root's key must be a plain name not starting with '.': {self.key!r}")

    def excludes(self, name: str) -> bool:
        """Whether `name`, directly under the root, is neither carried nor cleared."""
        return name in self.exclude or any(name.startswith(p) for p in self.exclude if p.endswith("-"))


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
    changed_only: tuple[str, ...] = ()
    """Keys of the roots the archive holds as changes over the image's files (Root.pristine)."""


_WALK = r"""
import json, os, stat, sys
def excluded(name, exclude):
    return name in exclude or any(name.startswith(p) for p in exclude if p.endswith("-"))
def sig(info):
    return [info.st_dev, info.st_ino, info.st_mode, info.st_size, info.st_mtime_ns, info.st_ctime_ns]
def walk(root, exclude, skip):
    # (relative name, absolute path) of every entry under root, parents first, never through a link
    for here, dirs, files in os.walk(root):
        rel = os.path.relpath(here, root)
        if rel == ".":
            dirs[:] = [d for d in dirs if not excluded(d, exclude)]
            files = [f for f in files if not excluded(f, exclude)]
        dirs[:] = [d for d in dirs if os.path.join(here, d) != skip]
        for name in sorted(dirs) + sorted(files):
            yield os.path.normpath(os.path.join(rel, name)), os.path.join(here, name)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(here, d))]
"""

_BASE = (
    _WALK
    + r"""
args = json.loads(sys.argv[1])
for key, root, exclude in args["roots"]:
    listing = {}
    if os.path.isdir(root) and not os.path.islink(root):
        for rel, path in walk(root, exclude, args["out"]):
            try:
                listing[rel] = sig(os.lstat(path))
            except OSError:
                pass
    path = os.path.join(args["out"], key + ".json")
    with open(path + ".new", "w") as handle:
        json.dump(listing, handle)
    os.rename(path + ".new", path)
"""
)

_CAPTURE = (
    _WALK
    + r"""
import io, tarfile
args = json.loads(sys.argv[1])
out, limit, total, skipped, deleted, changed_only = args["out"], args["max_bytes"], 0, [], [], []
tar = tarfile.open(os.path.join(out, "files.tar"), "w", format=tarfile.PAX_FORMAT)
def count(size):
    global total
    total += size
    if total > limit:
        sys.stderr.write("over %d bytes" % limit)
        sys.exit(3)
def add(name, path, info):
    t = tarfile.TarInfo(name)
    t.mode, t.mtime, t.uid, t.gid = stat.S_IMODE(info.st_mode), int(info.st_mtime), 0, 0
    if stat.S_ISLNK(info.st_mode):
        t.type, t.linkname = tarfile.SYMTYPE, os.readlink(path)
        tar.addfile(t)
    elif stat.S_ISDIR(info.st_mode):
        t.type = tarfile.DIRTYPE
        tar.addfile(t)
    elif stat.S_ISREG(info.st_mode):
        count(info.st_size)
        t.size = info.st_size
        with open(path, "rb") as handle:
            tar.addfile(t, handle)
    else:
        skipped.append(name)
for key, root, exclude, base in args["roots"]:
    if not os.path.isdir(root) or os.path.islink(root):
        continue
    listing = None
    if base:
        try:
            with open(base) as handle:
                listing = json.load(handle)
        except (OSError, ValueError):  # the job's listing is gone: the whole tree
            listing = None
    if listing is not None:
        changed_only.append(key)
    add(key, root, os.lstat(root))
    seen = set()
    for rel, path in walk(root, exclude, out):
        member = key + "/" + rel
        try:
            info = os.lstat(path)
            seen.add(rel)
            if listing is None or listing.get(rel) != sig(info):
                add(member, path, info)
        except OSError:
            skipped.append(member)
    if listing is not None:
        gone = set(listing) - seen
        deleted += sorted(key + "/" + rel for rel in gone if os.path.dirname(rel) not in gone)
if deleted:
    data = "\0".join(deleted).encode("utf-8", "surrogateescape")
    count(len(data))
    t = tarfile.TarInfo(".deleted")
    t.size, t.mode = len(data), 0o600
    tar.addfile(t, io.BytesIO(data))
tar.close()
with open(os.path.join(out, "state.json"), "w") as handle:
    json.dump({"cwd": os.getcwd(), "env": dict(os.environ), "skipped": skipped, "changed_only": changed_only}, handle)
"""
)

_RESTORE = r"""
import json, os, shutil, stat, sys, tarfile
args = json.loads(sys.argv[1])
def excluded(name, exclude):
    return name in exclude or any(name.startswith(p) for p in exclude if p.endswith("-"))
roots = {key: (path, set(exclude)) for key, path, exclude in args["roots"]}
changed_only = set(args.get("changed_only", ()))
tar = tarfile.open(args["archive"])
members = tar.getmembers()
def check(name):
    parts = name.split("/")
    if parts[0] not in roots or ".." in parts or name.startswith("/"):
        sys.exit("bad member %r" % name)
    if len(parts) > 1 and excluded(parts[1], roots[parts[0]][1]):
        sys.exit("bad member %r: an excluded path" % name)
names, links, deleted = set(), set(), []
for m in members:
    if m.name == ".deleted":
        if not m.isreg():
            sys.exit("bad member type %r" % m.name)
        deleted = [n for n in tar.extractfile(m).read().decode("utf-8", "surrogateescape").split("\0") if n]
        continue
    check(m.name)
    if not (m.isdir() or m.isreg() or m.issym()):
        sys.exit("bad member type %r" % m.name)
    names.add(m.name)
    if m.issym():
        links.add(m.name)
for name in names:
    parts = name.split("/")
    if any("/".join(parts[:i]) in links for i in range(2, len(parts))):
        sys.exit("bad member %r: beneath a link" % name)
for name in deleted:
    check(name)
    if name.split("/")[0] not in changed_only or "/" not in name:
        sys.exit("bad member %r: not a deletion in a root kept as its changes" % name)
def target(name):
    # The member's path; never through a link on the way (the fork's own tree may hold one)
    key, _, rel = name.partition("/")
    path = roots[key][0]
    for part in rel.split("/")[:-1]:
        path = os.path.join(path, part)
        if os.path.islink(path):
            sys.exit("bad member %r: through a link" % name)
    return os.path.join(roots[key][0], rel) if rel else roots[key][0]
def remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
skip = os.path.dirname(args["archive"])
for key, (root, exclude) in roots.items():
    os.makedirs(root, exist_ok=True)
    if key in changed_only:  # the image's files, but for the changes below
        continue
    for here, dirs, files in os.walk(root, topdown=False):
        rel = os.path.relpath(here, root)
        for name in files + dirs:
            path = os.path.join(here, name)
            top = name if rel == "." else rel.split(os.sep)[0]  # an excluded name's files are left, too
            if excluded(top, exclude) or path == skip or skip.startswith(path + os.sep):
                continue
            if key + "/" + os.path.normpath(os.path.join(rel, name)) in names:
                if not os.path.islink(path) and not os.path.isdir(path):
                    os.unlink(path)
                continue
            remove(path)
for name in deleted:
    remove(target(name))
dirs = []
for m in members:
    if m.name == ".deleted":
        continue
    path = target(m.name)
    if m.isdir():
        if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
            os.unlink(path)
        os.makedirs(path, exist_ok=True)
        dirs.append((path, m))
        continue
    remove(path)
    if m.issym():
        os.symlink(m.linkname, path)
        continue
    with tar.extractfile(m) as source, open(path, "wb") as target_file:
        shutil.copyfileobj(source, target_file)
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


async def record_base(sandbox: Sandbox, roots: Sequence[Root]) -> str | None:
    """List the pristine roots' entries as they are now, before the job's first turn (and before
    a fork's restore), in a folder of the sandbox's temporary directory (`.prorl-fork-base-*`:
    the runtime's scratch, neither carried nor cleared); its path, for `capture`. None when no
    root is pristine."""
    pristine = [root for root in roots if root.pristine]
    if not pristine:
        return None
    if sandbox.mode != "runtime":
        raise SnapshotRefused("the sandbox's image has no python3 (exec mode): its state cannot be kept")
    paths = await _paths(sandbox, pristine)
    folder = posixpath.join(await _tmpdir(sandbox), f".prorl-fork-base-{secrets.token_hex(6)}")
    await sandbox.bash(f"(mkdir -m 700 -p {shlex.quote(folder)})", timeout_s=60)
    args = {"out": folder, "roots": [[r.key, paths[r.key], list(r.exclude)] for r in pristine]}
    await _run_script(sandbox, _BASE, args, "listing the image's files")
    return folder


async def capture(sandbox: Sandbox, roots: Sequence[Root], *, max_bytes: int, base: str | None = None) -> SandboxState:
    """The sandbox's files under `roots`, its shell's directory and environment, now; the
    pristine roots as their changes since `base` (record_base's folder) when it is given."""
    if sandbox.mode != "runtime":
        raise SnapshotRefused("the sandbox's image has no python3 (exec mode): its state cannot be kept")
    paths = await _paths(sandbox, roots)
    out = posixpath.join(paths.get("tmp") or await _tmpdir(sandbox), f".prorl-fork-{secrets.token_hex(6)}")
    await sandbox.bash(f"(mkdir -m 700 -p {shlex.quote(out)})", timeout_s=60)
    try:
        args = {
            "out": out,
            "max_bytes": max_bytes,
            "roots": [
                [
                    r.key,
                    paths[r.key],
                    list(r.exclude),
                    posixpath.join(base, f"{r.key}.json") if base and r.pristine else "",
                ]
                for r in roots
            ],
        }
        await _run_script(sandbox, _CAPTURE, args, "the snapshot")
        archive = await sandbox.read_file(posixpath.join(out, "files.tar"), max_bytes=max_bytes + (16 << 20))
        state = json.loads(await sandbox.read_file(posixpath.join(out, "state.json"), max_bytes=16 << 20))
    finally:
        await sandbox.bash(f"(rm -rf {shlex.quote(out)})", timeout_s=60)
    changed_only = tuple(str(key) for key in state.get("changed_only", ()))
    await asyncio.to_thread(check_archive, archive, roots, max_bytes, changed_only)
    return SandboxState(
        archive=archive,
        cwd=_relative_cwd(str(state["cwd"]), paths),
        env={str(k): str(v) for k, v in state["env"].items()},
        paths=paths,
        skipped=tuple(state.get("skipped", ())),
        changed_only=changed_only,
    )


async def restore(sandbox: Sandbox, roots: Sequence[Root], state: SandboxState) -> None:
    """Make `sandbox`'s files under `roots` those of `state` (nothing more, nothing less; a root
    kept as its changes gets them over the image's files, which a fresh sandbox has), then put its
    shell in the state's directory with the state's environment."""
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
        args = {
            "archive": archive,
            "roots": [[r.key, paths[r.key], list(r.exclude)] for r in roots],
            "changed_only": list(state.changed_only),
        }
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


def check_archive(archive: bytes, roots: Sequence[Root], max_bytes: int, changed_only: Sequence[str] = ()) -> None:
    """Refuse an archive that could carry anything out of the sandbox, or is too large:
    members only under the roots' keys, relative, without `..`, never in a root's excluded
    names (a repository's `.git`) nor beneath a symbolic link of the archive; only
    directories, regular files and symbolic links (never hard links, devices, FIFOs);
    deletions (the `.deleted` member) only inside the roots kept as their changes, which
    must be pristine roots; regular files within `max_bytes` in all. The host never unpacks
    it; this check is the host's own word on it."""
    if len(archive) > max_bytes + (16 << 20):
        raise SnapshotRefused(f"the snapshot is over the cap of {max_bytes} bytes")
    by_key = {root.key: root for root in roots}
    if any(key not in by_key or not by_key[key].pristine for key in changed_only):
        raise SnapshotRefused(f"the snapshot keeps as changes roots that are not the image's: {list(changed_only)!r}")
    total = 0
    names: list[str] = []
    links: set[str] = set()
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
            for member in tar:
                name = member.name
                if name == DELETED:
                    if not member.isreg():
                        raise SnapshotRefused(f"the snapshot holds a member of a refused type: {name!r}")
                    total += member.size
                    if total > max_bytes:
                        raise SnapshotRefused(f"the snapshot is over the cap of {max_bytes} bytes")
                    listed = tar.extractfile(member)
                    assert listed is not None
                    for entry in listed.read().split(b"\0"):
                        if entry:
                            _check_deletion(entry.decode("utf-8", "surrogateescape"), by_key, changed_only)
                    continue
                _check_name(name, by_key)
                if not (member.isdir() or member.isreg() or member.issym()):
                    raise SnapshotRefused(f"the snapshot holds a member of a refused type: {name[:200]!r}")
                total += member.size if member.isreg() else 0
                if total > max_bytes:
                    raise SnapshotRefused(f"the snapshot is over the cap of {max_bytes} bytes")
                names.append(name)
                if member.issym():
                    links.add(name)
    except tarfile.TarError as exc:
        raise SnapshotRefused(f"the snapshot is not a readable archive: {exc}") from None
    for name in names:
        parts = name.split("/")
        if any("/".join(parts[:i]) in links for i in range(2, len(parts))):
            raise SnapshotRefused(f"the snapshot holds a member beneath one of its links: {name[:200]!r}")


def _check_name(name: str, roots: Mapping[str, Root]) -> None:
    parts = name.split("/")
    if name.startswith("/") or ".." in parts or parts[0] not in roots:
        raise SnapshotRefused(f"the snapshot holds a member outside its paths: {name[:200]!r}")
    if len(parts) > 1 and roots[parts[0]].excludes(parts[1]):
        raise SnapshotRefused(f"the snapshot holds a member in a path it never carries: {name[:200]!r}")


def _check_deletion(name: str, roots: Mapping[str, Root], changed_only: Sequence[str]) -> None:
    _check_name(name, roots)
    key, _, rel = name.partition("/")
    if key not in changed_only or not rel:
        raise SnapshotRefused(f"the snapshot deletes what it may not: {name[:200]!r}")
