"""Terminal mode (Harbor / Terminal-Bench tasks).

The agent's work is its working directory, as a tar archive taken from the
agent's sandbox; this sandbox is a fresh one of the same image. The harness
empties the working directory and unpacks the archive into it (never through
a link, no device, no hard link, nothing outside it), puts the task's test
files in the tests folder (whatever stood there removed first), and runs the
test files with the pytest runner above from the working directory, as
Harbor's test.sh does (its pytest command puts no working directory on
sys.path, so neither does the runner here). The outcome is the reporter's; the tests folder is
compared after the run with what was put there.
"""

import base64
import os
import shutil
import tempfile

from .judge_processes import ERROR_CHARS
from .pytest_run import run_pytest
from .repo_files import capped_list, file_digest, say


def clear_dir(path):
    """Remove what `path` holds (not `path` itself); returns what could not be removed."""
    left = []
    for name in os.listdir(path):
        full = os.path.join(path, name)
        try:
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.unlink(full)
        except OSError:
            left.append(name)
    return left


def safe_parts(name):
    """The path components of an archive member or a test file name; None if it leaves its root."""
    if name.startswith("/"):
        return None
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if any(part == ".." for part in parts):
        return None
    return parts


def unpack_state(archive, root):
    """Unpack the agent's archive into `root`: (members written, members skipped with why)."""
    import tarfile

    real_root = os.path.realpath(root)
    written, skipped = 0, []
    with tarfile.open(archive, "r:") as tar:
        for member in tar:
            parts = safe_parts(member.name)
            if parts is None:
                skipped.append("%s (outside the working directory)" % member.name[:200])
                continue
            if not parts:
                continue
            target = os.path.join(real_root, *parts)
            if os.path.realpath(os.path.dirname(target)) != os.path.join(real_root, *parts[:-1]):
                skipped.append("%s (through a link)" % member.name[:200])
                continue
            if os.path.lexists(target) and not (member.isdir() and os.path.isdir(target)):
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target)
                else:
                    os.unlink(target)
            if member.isdir():
                if not os.path.isdir(target):
                    os.mkdir(target)
                os.chmod(target, (member.mode & 0o777) | 0o700)
            elif member.isfile():
                source = tar.extractfile(member)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as handle:
                    shutil.copyfileobj(source, handle)
                os.chmod(target, (member.mode & 0o777) | 0o600)
            elif member.issym():
                os.symlink(member.linkname, target)
            else:
                skipped.append("%s (not a file, folder or symbolic link)" % member.name[:200])
                continue
            written += 1
    return written, skipped


def tree_digests(root):
    """{path: digest} of every file and link under `root` (folders by their content)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            path = os.path.join(folder, name)
            found[path] = file_digest(path)
    return found


def judge_terminal(spec):
    workdir = tempfile.mkdtemp(prefix="prorl-judge-")
    try:
        return _judge_terminal(spec, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _judge_terminal(spec, scratch):
    app = os.path.realpath(str(spec["workdir"]))
    tests_dir = os.path.abspath(str(spec["tests_dir"]))
    verdict = {"stage": "state", "skipped": []}
    real_tests = os.path.realpath(tests_dir)
    for one, other in ((app, real_tests), (real_tests, app)):
        if one == other or one.startswith(other.rstrip("/") + "/"):
            verdict.update(stage="tests_in_place", ok=False, output="the working directory and the tests overlap")
            return verdict
    archive = str(spec.get("state") or "")
    try:
        if not os.path.isdir(app):
            os.makedirs(app)
        left = clear_dir(app)
        if left:
            say("could not empty the working directory: %s" % capped_list(left, 20))
        if archive:
            written, skipped = unpack_state(archive, app)
            verdict["skipped"] = capped_list(skipped, 50)
            say("unpacked %d entries of the agent's working directory into %s" % (written, app))
            os.unlink(archive)
    except Exception as exc:  # a broken archive is the agent's doing (it made the files)
        verdict.update(ok=False, output="%s: %s" % (type(exc).__name__, str(exc)[:ERROR_CHARS]))
        return verdict
    verdict["stage"] = "tests_in_place"
    digests, paths = {}, []
    try:
        if os.path.islink(tests_dir) or (os.path.lexists(tests_dir) and not os.path.isdir(tests_dir)):
            os.unlink(tests_dir)
        if os.path.isdir(tests_dir):
            left = clear_dir(tests_dir)
            if left:
                raise OSError("cannot empty %s: %s" % (tests_dir, capped_list(left, 20)))
        else:
            os.makedirs(tests_dir)
        for name, encoded in sorted(dict(spec.get("tests") or {}).items()):
            parts = safe_parts(str(name))
            if not parts:
                raise OSError("a test file named %r" % name)
            target = os.path.join(tests_dir, *parts)
            if not os.path.isdir(os.path.dirname(target)):
                os.makedirs(os.path.dirname(target))
            with open(target, "wb") as handle:
                handle.write(base64.b64decode(encoded))
            os.chmod(target, 0o755 if name.endswith(".sh") else 0o644)
        for name in spec.get("logs_dirs") or []:
            if os.path.isdir(name) and not os.path.islink(name):
                clear_dir(name)
            elif not os.path.lexists(name):
                try:
                    os.makedirs(name)
                except OSError:
                    pass
    except Exception as exc:  # nothing of the agent's here: the image's or the task's doing
        verdict.update(ok=False, output="%s: %s" % (type(exc).__name__, str(exc)[:ERROR_CHARS]))
        return verdict
    before = tree_digests(tests_dir)
    for path, digest in before.items():
        digests[os.path.relpath(os.path.realpath(path), app)] = digest
    for name in spec["run"]:
        paths.append(os.path.join(tests_dir, *safe_parts(str(name))))
    verdict["stage"] = "tests"
    run_spec = {"timeout_s": spec["timeout_s"], "cwd_on_path": False}
    verdict.update(ok=True, **run_pytest(app, run_spec, paths, scratch, digests))
    after = tree_digests(tests_dir)
    changed = [
        "%s (%s)" % (path, "new" if path not in before else "deleted" if path not in after else "rewritten")
        for path in sorted(set(before) | set(after))
        if before.get(path) != after.get(path)
    ]
    if changed:
        verdict["anomalies"] = list(verdict.get("anomalies") or []) + [
            "the tests' files changed during the run: %s" % ", ".join(capped_list(changed, 20))
        ]
    return verdict
