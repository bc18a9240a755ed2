"""The repository as swe mode handles it: what counts as test infrastructure, git and
patches, restoring what the model's patch may not touch, and the digests that tell
after the run whether a test file or piece of infrastructure changed.
"""

import os
import shutil
import subprocess

from .judge_processes import ERROR_CHARS, clean_env
from .pipe_frames import write_all

# Files pytest or Python load as configuration or plugins, wherever they sit. Matched
# without regard to case: importlib.metadata finds `X.DIST-INFO` folders, and a
# case-insensitive file system would load `CONFTEST.PY`.
INFRA_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        ".pytest.toml",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "entry_points.txt",  # only read inside metadata folders, matched anywhere
        ".gitattributes",  # changes how git applies the test patch
    }
)
# Modules Python's site imports at start-up, in any form (a .py, a package, an extension).
INFRA_STEMS = frozenset({"sitecustomize", "usercustomize"})
INFRA_SUFFIXES = (".pth", ".pyc", ".pyo", ".egg-link", ".egg")
# Folders whose content is packaging metadata (entry points: pytest11 plugins) or bytecode.
INFRA_DIR_SUFFIXES = (".dist-info", ".egg-info", ".egg")
INFRA_DIRS = frozenset({"__pycache__", ".pytest_cache"})


def is_test_infrastructure(path):
    """Whether a repository path (posix, relative) is configuration or a plugin
    that Python or pytest would load: the model's patch may not change it. Case
    does not matter."""
    parts = [part.lower() for part in path.split("/") if part]
    if not parts:
        return False
    name = parts[-1]
    if name in INFRA_NAMES or name.endswith(INFRA_SUFFIXES) or name.split(".", 1)[0] in INFRA_STEMS:
        return True
    return any(part in INFRA_DIRS or part.endswith(INFRA_DIR_SUFFIXES) or part in INFRA_STEMS for part in parts)


def test_file_of(node_id):
    return node_id.split("::", 1)[0]


def git_env():
    return clean_env(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL="/dev/null", GIT_TERMINAL_PROMPT="0")


def git(repo, args, stdin=None, timeout=120):
    """(exit code, stdout, stderr) of a git command run without a shell."""
    try:
        done = subprocess.run(
            ["git"] + list(args),
            cwd=repo,
            input=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=git_env(),
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return -1, b"", b"git %s timed out" % args[0].encode()
    return done.returncode, done.stdout, done.stderr


def nul_paths(data):
    return [os.fsdecode(item) for item in data.split(b"\0") if item]


def patch_paths(repo, patch_file):
    """Every path a patch touches (old and new names), exactly as git reads it."""
    code, out, err = git(repo, ["apply", "--numstat", "-z", patch_file])
    if code != 0:
        return []
    paths, tokens, index = [], out.split(b"\0"), 0
    while index < len(tokens):
        fields = tokens[index].split(b"\t", 2)
        index += 1
        if len(fields) < 3:
            continue
        if fields[2]:
            paths.append(os.fsdecode(fields[2]))
        elif index + 1 < len(tokens):  # a rename: old and new name follow
            paths += [os.fsdecode(tokens[index]), os.fsdecode(tokens[index + 1])]
            index += 2
    return paths


def changed_paths(repo, base, untracked_before):
    """(tracked paths that differ from base, files that are new) in the work tree."""
    _, tracked, _ = git(repo, ["diff", "-z", "--name-only", "--no-renames", base, "--"])
    _, others, _ = git(repo, ["ls-files", "-z", "--others"])
    return set(nul_paths(tracked)), set(nul_paths(others)) - untracked_before


def restore_protected(repo, base, protected, untracked_before):
    """Put every protected path the patch changed back as it is at base.

    Returns (restored, deleted, still_changed)."""
    tracked, new = changed_paths(repo, base, untracked_before)
    restore = sorted(path for path in tracked if protected(path))
    delete = sorted(path for path in new if protected(path))
    for path in delete:
        full = os.path.join(repo, path)
        try:
            os.unlink(full)
        except IsADirectoryError:
            shutil.rmtree(full, ignore_errors=True)
        except OSError:
            pass
        parent = os.path.dirname(full)
        while parent.startswith(repo.rstrip("/") + "/"):
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)
    if restore:
        spec = b"\0".join(os.fsencode(path) for path in restore)
        git(
            repo,
            ["--literal-pathspecs", "checkout", base, "--pathspec-from-file=-", "--pathspec-file-nul"],
            stdin=spec,
        )
    tracked, new = changed_paths(repo, base, untracked_before)
    still = sorted(path for path in tracked | new if protected(path))
    return restore, delete, still


def apply_patch(repo, text, name, workdir):
    path = os.path.join(workdir, name)
    with open(path, "wb") as handle:
        handle.write(text.encode("utf-8", "surrogateescape"))
    code, out, err = git(repo, ["apply", "--verbose", "--whitespace=nowarn", path])
    log = (out + err).decode("utf-8", "replace")
    say("$ git apply %s\n%s" % (name, log))
    return code == 0, log[-ERROR_CHARS:], path


def say(text):
    """A line for the human-readable log (stdout), never part of the verdict."""
    try:
        write_all(1, (text.rstrip("\n") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def capped_list(paths, limit=200):
    return paths[:limit] + (["... and %d more" % (len(paths) - limit)] if len(paths) > limit else [])


def package_inits(paths):
    """The `__init__.py` of each test folder above each test file (from the first folder
    named test*, down): pytest imports a test module with its package and runs their
    code. The packages of the code under test are never among them."""
    found = set()
    for path in paths:
        parts = path.split("/")[:-1]
        first = next((index for index, part in enumerate(parts) if part.lower().startswith("test")), None)
        if first is None:
            continue
        for index in range(first + 1, len(parts) + 1):
            found.add("/".join(parts[:index] + ["__init__.py"]))
    return found


def applies_at_base(repo, base, patch_file, workdir):
    """Whether the patch applies to the base commit's tree (checked in a scratch index,
    the work tree untouched)."""
    env = dict(git_env(), GIT_INDEX_FILE=os.path.join(workdir, "base.index"))
    try:
        if subprocess.run(["git", "read-tree", base], cwd=repo, env=env, capture_output=True, timeout=120).returncode:
            return False
        done = subprocess.run(
            ["git", "apply", "--cached", "--check", patch_file], cwd=repo, env=env, capture_output=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def watched_files(repo, protected):
    """The protected paths present in the work tree (tracked or not, ignored included)."""
    _, listed, _ = git(repo, ["ls-files", "-z", "--cached", "--others"])
    return sorted(set(path for path in nul_paths(listed) if protected(path)))


def file_digest(path):
    """What a file is: a link's target, or the sha256 of its content; None when absent."""
    import hashlib

    try:
        if os.path.islink(path):
            return "link:" + os.readlink(path)
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()
    except OSError:
        return None


def file_digests(repo, paths):
    return dict((path, file_digest(os.path.join(repo, path))) for path in paths)


def files_changed(repo, protected, before):
    """The run's changes to the task's test files and test infrastructure: a test file
    rewritten or deleted, a conftest.py, a .pth, bytecode written (an anomaly each)."""
    after = watched_files(repo, protected)
    changed = []
    for path in sorted(set(before) | set(after)):
        if path not in before:
            changed.append("%s (new)" % path)
        else:
            now = file_digest(os.path.join(repo, path))
            if now != before[path]:
                changed.append("%s (%s)" % (path, "deleted" if now is None else "rewritten"))
    if not changed:
        return []
    return ["the tests' files changed during the run: %s" % ", ".join(capped_list(changed, 20))]
