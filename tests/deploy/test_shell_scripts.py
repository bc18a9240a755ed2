"""The deploy scripts without running them: bash parses them, shellcheck finds nothing, and
every PRORL_ variable the sbatch script uses is either a real setting or one of the script's
own, documented in its header. (tests/deploy/test_slurm_live.py runs the sbatch script.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.settings_names import OWN_VARIABLE, SETTING_VARIABLE, setting_of

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "prorl.sbatch"
SCRIPTS = [SBATCH, *sorted((ROOT / "deploy").rglob("*.sh"))]


def header(script: Path) -> str:
    """The comment block at the top (after the shebang), up to the first #SBATCH line or code."""
    lines = []
    for line in script.read_text().splitlines()[1:]:
        if not line.startswith("#") or line.startswith("#SBATCH"):
            break
        lines.append(line)
    return "\n".join(lines)


def test_the_scripts_are_found() -> None:
    names = {path.name for path in SCRIPTS}
    assert {"prorl.sbatch", "load-images.sh", "save-images.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_bash_parses_it(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_shellcheck_finds_nothing(script: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian package shellcheck)")
    done = subprocess.run(
        ["shellcheck", "--shell=bash", "--severity=info", str(script)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_settings_variable_of_the_sbatch_script_is_a_setting() -> None:
    used = set(SETTING_VARIABLE.findall(SBATCH.read_text()))
    assert "PRORL_SERVER__INSTANCE_ID" in used and "PRORL_JOBS__STORE" in used
    unknown = sorted(name for name in used if setting_of(name) is None)
    assert not unknown, f"not settings (prorl_server/config.py): {unknown}"


def test_the_sbatch_scripts_own_variables_are_documented_in_its_header() -> None:
    """A PRORL_ name without a double underscore is ignored by the servers: it must be one
    of the script's own, and a user can only know it from the header."""
    documented = set(OWN_VARIABLE.findall(header(SBATCH)))
    used = set(OWN_VARIABLE.findall(SBATCH.read_text()))
    assert "PRORL_POSTGRES_PORT" in used
    assert used <= documented, f"undocumented: {sorted(used - documented)}"


def test_the_sbatch_header_says_what_it_needs_how_to_submit_and_what_it_writes() -> None:
    text = header(SBATCH)
    for heading in ("What the nodes need", "How to submit it", "What it writes", "How to stop it"):
        assert f"# {heading}" in text
    assert re.search(r"sbatch --nodes=\d+ deploy/slurm/prorl\.sbatch", text)


def test_the_sbatch_script_runs_one_server_per_node() -> None:
    directives = [line.split(None, 1)[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH ")]
    assert "--ntasks-per-node=1" in directives and "--exclusive" in directives
    srun = [line for line in SBATCH.read_text().splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 and "--ntasks-per-node=1" in srun[0]
