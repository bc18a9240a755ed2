"""Regenerate prorl_server/verifiers/swebench/specs.json from swebench 4.1.0.

swebench 4.1.0 is the last release of the official harness that defines the
set-up and test commands per repository and version in code
(`swebench.harness.constants.python.MAP_REPO_VERSION_TO_SPECS_PY`); from 5.0
on, each published instance carries its own `eval_script`, `log_parser` and
`eval_type` instead. This script reads that module from the wheel without
installing swebench or any of its dependencies (the module imports nothing
but the standard library) and keeps, for every Python repository and version,
the fields the evaluation script uses: python, pre_install, install,
eval_commands and test_cmd.

    pip download --no-deps swebench==4.1.0 -d /tmp/swebench-wheel
    python scripts/swebench_specs.py /tmp/swebench-wheel/swebench-4.1.0-py3-none-any.whl
"""

from __future__ import annotations

import json
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "prorl_server" / "verifiers" / "swebench" / "specs.json"
MODULE = "swebench/harness/constants/python.py"
FIELDS = ("python", "pre_install", "install", "eval_commands", "test_cmd")
SKIPPED_REPOS = {"swe-bench/humaneval"}  # a seq2seq toy, not a repository


def load_specs(wheel: Path) -> dict[str, dict[str, Any]]:
    with zipfile.ZipFile(wheel) as archive:
        version = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        if "swebench-4.1.0.dist-info" not in version:
            raise SystemExit(f"{wheel}: expected the swebench 4.1.0 wheel, found {version}")
        source = archive.read(MODULE).decode()
    module = types.ModuleType("swebench_constants_python")
    exec(compile(source, MODULE, "exec"), module.__dict__)  # the official module: stdlib only
    specs: dict[str, dict[str, Any]] = module.MAP_REPO_VERSION_TO_SPECS_PY
    return {
        repo: {version: {k: spec[k] for k in FIELDS if k in spec} for version, spec in sorted(versions.items())}
        for repo, versions in sorted(specs.items())
        if repo not in SKIPPED_REPOS
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    specs = load_specs(Path(argv[0]))
    document = {"source": "swebench 4.1.0, swebench.harness.constants.python.MAP_REPO_VERSION_TO_SPECS_PY", **specs}
    OUT.write_text(json.dumps(document, indent=1, sort_keys=False) + "\n")
    print(f"wrote {OUT}: {sum(len(v) for v in specs.values())} versions of {len(specs)} repositories")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
