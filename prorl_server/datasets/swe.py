"""The shipped SWE tasks: real upstream bug fixes of PyPI projects, reverted.

Each task lives in `sandbox_images/swe/tasks/<instance_id>/`: `task.json`
(SWE-bench fields plus the PyPI sdist it is made from), `fix.patch` (the
upstream fix: the gold `patch`) and `test.patch` (the upstream test that
catches the bug). Its image holds the fixed release with both patches
reversed, committed as a git repository at `/testbed`; that commit is the
task's `base_commit`, made reproducible by a fixed author, committer and date.
Files under the task's `files/` (e.g. SymPy's `bin/test`, which its sdists
lack) are added to the repository before that commit.

A task whose task.json has `"layout": "testbed"` is built in SWE-bench's image
layout (Containerfile.testbed): a `testbed` environment at
/opt/miniconda3/envs/testbed holding the wheels pinned in `requirements`
(downloaded on the host) and the repository installed in development mode,
activated by `source /opt/miniconda3/bin/activate; conda activate testbed`.

Usage (standard library only, so the image build can run it):
  python -m prorl_server.datasets.swe prepare TASK_DIR CONTEXT_DIR   # build context of one image
  python -m prorl_server.datasets.swe pin TASK_DIR...                # record base_commit in task.json
  python -m prorl_server.datasets.swe tasks OUT.jsonl                # `prorl run` task lines
  python -m prorl_server.datasets.swe image|digest TASK_DIR          # its image name / content digest
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = ROOT / "sandbox_images" / "swe" / "tasks"
CONTAINERFILE = ROOT / "sandbox_images" / "swe" / "Containerfile.task"
TESTBED_CONTAINERFILE = ROOT / "sandbox_images" / "swe" / "Containerfile.testbed"
ACTIVATE_SHIM = ROOT / "sandbox_images" / "swe" / "activate"
REPO_DIR = "/testbed"
SDIST_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prorl" / "sdists"
WHEEL_CACHE = Path(os.environ.get("PRORL_WHEEL_CACHE", "/var/cache/prorl-wheels"))
_GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "prorl",
    "GIT_AUTHOR_EMAIL": "prorl@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "prorl",
    "GIT_COMMITTER_EMAIL": "prorl@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
}


def image_name(instance_id: str) -> str:
    return f"localhost/prorl-swe-{instance_id.lower()}:latest"


def task_dirs(root: Path = TASKS_DIR) -> list[Path]:
    return sorted(path.parent for path in root.glob("*/task.json"))


def load_task(task_dir: Path) -> dict[str, Any]:
    """The SWE-bench instance of one task folder, with its image name."""
    meta = json.loads((task_dir / "task.json").read_text())
    return {
        "instance_id": meta["instance_id"],
        "repo": meta["repo"],
        "version": meta["version"],
        "base_commit": meta.get("base_commit", ""),
        "problem_statement": meta["problem_statement"],
        "patch": (task_dir / "fix.patch").read_text(),
        "test_patch": (task_dir / "test.patch").read_text(),
        "FAIL_TO_PASS": meta["FAIL_TO_PASS"],
        "PASS_TO_PASS": meta["PASS_TO_PASS"],
        "pythonpath": meta.get("pythonpath", ""),
        "image": image_name(meta["instance_id"]),
        **({"eval_timeout_s": meta["eval_timeout_s"]} if "eval_timeout_s" in meta else {}),
    }


def _is_testbed(meta: dict[str, Any]) -> bool:
    return meta.get("layout") == "testbed"


def _wheels(meta: dict[str, Any], dest: Path) -> None:
    """The task's pinned requirements as wheels (pip download into the cache) copied to `dest`."""
    pins = [str(pin) for pin in meta.get("requirements", [])]
    dest.mkdir(parents=True, exist_ok=True)
    if not pins:
        return
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
         "--only-binary", ":all:", "--dest", str(WHEEL_CACHE), *pins],
        check=True,
    )  # fmt: skip
    for pin in pins:
        name, version = pin.split("==")
        stem = f"{name.replace('-', '_').lower()}-{version}-"
        found = [wheel for wheel in WHEEL_CACHE.glob("*.whl") if wheel.name.lower().startswith(stem)]
        if not found:
            raise SystemExit(f"no wheel of {pin} in {WHEEL_CACHE}")
        shutil.copy(found[0], dest / found[0].name)


def to_task(instance: dict[str, Any]) -> dict[str, Any]:
    """A `prorl run` line; the gold patch stays out of what the agent is given."""
    shown = {key: value for key, value in instance.items() if key != "patch"}
    return {"id": instance["instance_id"], "handler": "swe", "instance": shown}


def _sdist(meta: dict[str, Any]) -> Path:
    """The project's source release, fetched with pip download and checked against its sha256."""
    pypi = meta["pypi"]
    path: Path = SDIST_CACHE / pypi["sdist_filename"]
    if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != pypi["sha256"]:
        SDIST_CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             "--dest", str(SDIST_CACHE), f"{pypi['name']}=={pypi['version']}"],
            check=True,
        )  # fmt: skip
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != pypi["sha256"]:
        raise SystemExit(f"{path}: sha256 {digest} is not the pinned {pypi['sha256']}")
    return path


def _extract(archive: Path, into: Path) -> Path:
    """Unpack an sdist and return its single top-level folder."""
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as bundle:
            bundle.extractall(into)
    else:
        with tarfile.open(archive) as bundle:
            if hasattr(tarfile, "data_filter"):
                bundle.extractall(into, filter="data")
            else:  # Python before 3.11.4 (Debian 12's 3.11.2): the same refusals, by hand
                bundle.extractall(into, members=_plain_members(bundle))
    (top,) = [path for path in into.iterdir() if path.is_dir()]
    return top


def _plain_members(bundle: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """The archive's files and folders, refusing what tarfile's "data" filter refuses: absolute
    paths, paths out of the folder, links, devices (the sdist is pinned by sha256 anyway)."""
    members = bundle.getmembers()
    for member in members:
        parts = Path(member.name).parts
        if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
            raise SystemExit(f"refusing sdist member {member.name!r}: not a plain file or folder inside it")
    return members


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, **_GIT_IDENTITY}
    # safe.directory: as root, an sdist unpacks with its packager's file owner.
    # gc.auto=0: no packing in the background while the image build copies .git.
    done = subprocess.run(
        ["git", "-c", "safe.directory=*", "-c", "gc.auto=0", *args],
        cwd=repo,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


def build_repository(task_dir: Path, dest: Path) -> str:
    """Write the task's repository at its base commit to `dest`; return that commit."""
    meta = json.loads((task_dir / "task.json").read_text())
    with tempfile.TemporaryDirectory() as scratch:
        source = _extract(_sdist(meta), Path(scratch))
        for patch in ("test.patch", "fix.patch"):
            subprocess.run(["git", "apply", "-R", str(task_dir / patch)], cwd=source, check=True)
        extra = task_dir / "files"
        if extra.is_dir():
            shutil.copytree(extra, source, dirs_exist_ok=True)
        shutil.move(str(source), dest)
    _git(dest, "init", "--quiet", "--initial-branch=main")
    _git(dest, "add", "--all")
    _git(dest, "commit", "--quiet", "--no-gpg-sign", "-m", f"{meta['repo']} {meta['version']} without its fix")
    return _git(dest, "rev-parse", "HEAD")


def prepare(task_dir: Path, context: Path) -> None:
    """The image build context: the repository (checked against the pinned commit) and the Containerfile."""
    meta = json.loads((task_dir / "task.json").read_text())
    commit = build_repository(task_dir, context / "testbed")
    if commit != meta.get("base_commit"):
        raise SystemExit(
            f"{task_dir.name}: the repository builds as {commit}, task.json pins {meta.get('base_commit')!r}; "
            "run `python -m prorl_server.datasets.swe pin` if the task changed"
        )
    if _is_testbed(meta):
        shutil.copy(TESTBED_CONTAINERFILE, context / "Containerfile")
        shutil.copy(ACTIVATE_SHIM, context / "activate")
        _wheels(meta, context / "wheels")
        (context / "requirements.txt").write_text("".join(f"{pin}\n" for pin in meta.get("requirements", [])))
    else:
        shutil.copy(CONTAINERFILE, context / "Containerfile")


def digest(task_dir: Path) -> str:
    """Changes whenever anything the task's image is built from changes."""
    sha = hashlib.sha256()
    meta = json.loads((task_dir / "task.json").read_text())
    recipe = [TESTBED_CONTAINERFILE, ACTIVATE_SHIM] if _is_testbed(meta) else [CONTAINERFILE]
    extra = sorted(path for path in (task_dir / "files").rglob("*") if path.is_file())
    for path in [*recipe, *(task_dir / name for name in ("task.json", "fix.patch", "test.patch")), *extra]:
        sha.update(path.relative_to(ROOT).as_posix().encode() if path in extra else b"")
        sha.update(path.read_bytes())
    return sha.hexdigest()[:16]


def pin(task_dir: Path) -> str:
    with tempfile.TemporaryDirectory() as scratch:
        commit = build_repository(task_dir, Path(scratch) / "testbed")
    path = task_dir / "task.json"
    meta = json.loads(path.read_text())
    meta["base_commit"] = commit
    path.write_text(json.dumps(meta, indent=2) + "\n")
    return commit


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "prepare":
        prepare(Path(argv[1]), Path(argv[2]))
    elif argv and argv[0] == "pin":
        for task_dir in [Path(arg) for arg in argv[1:]] or task_dirs():
            print(task_dir.name, pin(task_dir))
    elif len(argv) == 2 and argv[0] == "tasks":
        lines = [json.dumps(to_task(load_task(task_dir))) + "\n" for task_dir in task_dirs()]
        Path(argv[1]).write_text("".join(lines))
        print(f"wrote {len(lines)} SWE tasks to {argv[1]}")
    elif len(argv) == 2 and argv[0] == "image":
        print(image_name(load_task(Path(argv[1]))["instance_id"]))
    elif len(argv) == 2 and argv[0] == "digest":
        print(digest(Path(argv[1])))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
