"""The in-sandbox program (the package prorl_sandbox_runtime and its two entry
scripts, prorl_runtime.py and prorl_judge.py), where to find it on the host, and
how to stage it for a sandbox.

The program is stdlib-only and runs on the sandbox image's own python3 (3.8 and
newer); the folder `stage` fills is bind-mounted read-only into each container
(the fake provider runs the runtime from such a folder too). This package's other
modules run in the server.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

RUNTIME_DIR = Path(__file__).parent
RUNTIME_FILE = RUNTIME_DIR / "prorl_runtime.py"
JUDGE_FILE = RUNTIME_DIR / "prorl_judge.py"
"""The judging harness, staged beside the runtime (it starts it for `judge`)."""
PACKAGE_DIR = RUNTIME_DIR / "prorl_sandbox_runtime"


def program_files() -> list[Path]:
    """What a sandbox needs, relative to RUNTIME_DIR: the two entry scripts and the package's
    modules (no byte code: the staged folder is read-only and the judge runs with -B)."""
    modules = sorted(path.relative_to(RUNTIME_DIR) for path in PACKAGE_DIR.glob("*.py"))
    return [Path(RUNTIME_FILE.name), Path(JUDGE_FILE.name), *modules]


def stage(target: Path, *, read_only: bool = False) -> None:
    """Make `target` hold exactly the program's files (mode 0644, folders 0755), each replaced
    atomically when it differs; a module no longer part of the package (or byte code) is
    removed, so none lingers from an older server. `read_only`: folders 0555 too (for a folder no later
    `stage` fills again). Blocking."""
    wanted = program_files()
    for folder in (target, target / PACKAGE_DIR.name):
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o755)
    for stale in (target / PACKAGE_DIR.name).iterdir():
        if stale.relative_to(target) in wanted:
            continue
        if stale.name == "__pycache__" and not stale.is_symlink():
            shutil.rmtree(stale)
        elif stale.suffix in (".py", ".pyc"):
            stale.unlink()  # (another server's copy in progress, *.tmp, is left alone)
    for relative in wanted:
        source, staged = RUNTIME_DIR / relative, target / relative
        if not staged.exists() or staged.read_bytes() != source.read_bytes():
            temporary = staged.with_name(f"{staged.name}.{os.getpid()}.tmp")
            shutil.copyfile(source, temporary)
            temporary.chmod(0o644)
            temporary.replace(staged)
    if read_only:
        for folder in (target / PACKAGE_DIR.name, target):
            folder.chmod(0o555)
