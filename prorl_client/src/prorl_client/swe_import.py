"""`prorl import-swe FILE --format FORMAT --out TASKS.jsonl`: SWE datasets as `prorl run` task lines.

Reads an instance file as the datasets publish them (a JSON list, JSON Lines,
or Parquet, which needs pyarrow) and writes one `swe` task line per instance
it can judge: {"id": instance_id, "handler": "swe", "instance": {...}} with
SWE-bench's fields (instance_id, repo, version, base_commit,
problem_statement, test_patch, FAIL_TO_PASS and PASS_TO_PASS as lists), the
image to run it in, and `evaluation`, which says how it is judged. The gold
patch is left out, as `prorl-server tasks swe` leaves it out. Every instance
it cannot judge is refused with its reason, on standard error.

Formats (field names as each dataset publishes them):
- swe-bench (SWE-bench, Lite, Verified, Multimodal's Python rows, and sets
  shaped like them): `repo`, `instance_id`, `base_commit`, `version`,
  `FAIL_TO_PASS`/`PASS_TO_PASS` (JSON strings of lists), `test_patch`; image
  `swebench/sweb.eval.x86_64.<instance_id, "__" as "_1776_">:latest` (what
  swebench pulls), or the row's own `image` (swebench 5 rows, which also carry
  `eval_script`, `log_parser` and `eval_type`, kept).
- swe-gym (SWE-Gym, SWE-Gym-Lite): SWE-bench's fields; image
  `xingyaoww/sweb.eval.x86_64.<instance_id, "__" as "_s_">:latest` (OpenHands').
- swe-smith (SWE-smith): `instance_id`, `repo` (its mirror,
  `owner__name.commit8`), `image_name`, `problem_statement`,
  `FAIL_TO_PASS`/`PASS_TO_PASS` (lists), `base_commit` when the export has it.
- r2e-gym (R2E-Gym, R2E-Gym-Lite): `repo_name`, `docker_image`,
  `commit_hash`, `problem_statement`, `expected_output_json`; rows shaped like
  SWE-bench's (R2E-Gym's SWE-Bench-Verified) are read as swe-bench rows with
  `docker_image` as their image.

Judged (`evaluation`): `instance` when the row carries its own swebench 5
evaluation (`eval_script` and `log_parser`); `official` when swebench defines
the evaluation of its repository and version (swebench 4.1.0's specs: Django's
tests/runtests.py, SymPy's bin/test, pytest, ...); `pytest` otherwise, when
every selected test is a pytest node id (`path.py::name`), as SWE-Gym's and
SWE-smith's own harnesses run them. Anything else is refused: no
FAIL_TO_PASS, no base commit in the image, an unknown repository or version
whose tests are not pytest node ids, a malformed field.

`--registry` puts the images under another registry or a local name
(`--registry localhost` for images pre-loaded with `podman load` and tagged
`localhost/swebench/...`); by default they are fully qualified on docker.io,
so that Podman resolves no short names.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

FORMATS = ("swe-bench", "swe-gym", "swe-smith", "r2e-gym")
DEFAULT_REGISTRY = "docker.io"
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
_PYTEST_ID = re.compile(r"^[^\s:]+\.py::\S")
_REGISTRY_HOST = re.compile(r"^(localhost|[^/]*[.:][^/]*)/")

# swebench 4.1.0's MAP_REPO_VERSION_TO_SPECS (Python repositories, the versions
# with a test command): kept equal to prorl_server/verifiers/swebench/specs.json
# by tests/unit/client/test_swe_import.py (the client does not import the server).
_OFFICIAL_VERSIONS = {
    "astropy/astropy": "0.1 0.2 0.3 0.4 1.1 1.2 1.3 3.0 3.1 3.2 4.1 4.2 4.3 5.0 5.1 5.2 v5.3",
    "django/django": "1.4 1.5 1.6 1.7 1.8 1.9 1.10 1.11 2.0 2.1 2.2 3.0 3.1 3.2 4.0 4.1 4.2 5.0 5.1 5.2",
    "marshmallow-code/marshmallow": "2.18 2.19 2.20 3.0 3.1 3.2 3.4 3.8 3.9 3.10 3.11 3.12 3.13 3.15 3.16 3.19",
    "matplotlib/matplotlib": "1.0 1.1 1.2 1.3 1.4 1.5 2.0 2.1 2.2 3.0 3.1 3.2 3.3 3.4 3.5 3.6 3.7 3.8 3.9",
    "mwaskom/seaborn": "0.11 0.12 0.13 0.14",
    "pallets/flask": "2.0 2.1 2.2 2.3 3.0 3.1",
    "psf/requests": (
        "0.7 0.8 0.9 0.11 0.13 0.14 1.1 1.2 2.0 2.2 2.3 2.4 2.5 2.7 2.8 2.9 2.10 2.11 2.12 2.17 "
        "2.18 2.19 2.22 2.25 2.26 2.27 2.31 3.0"
    ),
    "pvlib/pvlib-python": "0.1 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9",
    "pydata/xarray": "0.12 0.18 0.19 0.20 2022.03 2022.06 2022.09 2023.07 2024.05",
    "pydicom/pydicom": "1.0 1.1 1.2 1.3 1.4 2.0 2.1 2.2 2.3 2.4 3.0",
    "pylint-dev/astroid": "2.5 2.6 2.7 2.8 2.9 2.10 2.12 2.13 2.14 2.15 2.16 3.0",
    "pylint-dev/pylint": "2.8 2.9 2.10 2.11 2.13 2.14 2.15 2.16 2.17 3.0 3.1 3.2 3.3 4.0",
    "pytest-dev/pytest": "4.4 4.5 4.6 5.0 5.1 5.2 5.3 5.4 6.0 6.2 6.3 7.0 7.1 7.2 7.4 8.0 8.1 8.2 8.3 8.4",
    "pyvista/pyvista": (
        "0.20 0.21 0.22 0.23 0.24 0.25 0.26 0.27 0.28 0.29 0.30 0.31 0.32 0.33 0.34 0.35 0.36 0.37 "
        "0.38 0.39 0.40 0.41 0.42 0.43"
    ),
    "scikit-learn/scikit-learn": "0.20 0.21 0.22 1.3 1.4 1.5 1.6",
    "sphinx-doc/sphinx": (
        "1.5 1.6 1.7 1.8 2.0 2.1 2.2 2.3 2.4 3.0 3.1 3.2 3.3 3.4 3.5 4.0 4.1 4.2 4.3 4.4 4.5 5.0 "
        "5.1 5.2 5.3 6.0 6.2 7.0 7.1 7.2 7.3 7.4 8.0 8.1"
    ),
    "sqlfluff/sqlfluff": "0.4 0.5 0.6 0.8 0.9 0.10 0.11 0.12 0.13 1.0 1.1 1.2 1.3 1.4 2.0 2.1 2.2",
    "sympy/sympy": "0.7 1.0 1.1 1.2 1.4 1.5 1.6 1.7 1.8 1.9 1.10 1.11 1.12 1.13 1.14",
}
OFFICIAL_VERSIONS: dict[str, frozenset[str]] = {
    repo: frozenset(versions.split()) for repo, versions in _OFFICIAL_VERSIONS.items()
}


class Refused(ValueError):
    """An instance that cannot be judged: the message says why."""


@dataclass(frozen=True)
class Imported:
    tasks: list[dict[str, Any]]
    refused: list[tuple[str, str]]
    """(instance id or row number, reason)."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON list, a JSON Lines or a Parquet file."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as parquet  # type: ignore[import-not-found,import-untyped,unused-ignore]
        except ImportError:
            raise SystemExit(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        rows: list[dict[str, Any]] = parquet.read_table(path).to_pylist()
        return rows
    text = path.read_text()
    if path.suffix == ".json" or text.lstrip().startswith("["):
        document = json.loads(text)
        if isinstance(document, dict) and isinstance(document.get("rows"), list):  # a viewer's export
            document = [item.get("row", item) for item in document["rows"]]
        if not isinstance(document, list):
            raise SystemExit(f"{path}: expected a JSON list of instances")
        return [row for row in document]
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}:{number}: not JSON: {exc}") from None
    return rows


def _text(row: dict[str, Any], field: str, *, required: bool = True) -> str:
    value = row.get(field)
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise Refused(f"no {field}")
        return ""
    if isinstance(value, float | int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise Refused(f"{field} is a {type(value).__name__}, not text")
    return value


def _tests(row: dict[str, Any], field: str) -> list[str]:
    value = row.get(field, [])
    if value is None:
        value = []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError:
            raise Refused(f"{field} is a string but not a JSON list") from None
    if not isinstance(value, list | tuple) or not all(isinstance(test, str) and test.strip() for test in value):
        raise Refused(f"{field} is not a list of test names")
    return list(value)


def _image(name: str, registry: str) -> str:
    name = name.strip().lower()
    if ":" not in name.rsplit("/", 1)[-1] and "@" not in name:
        name += ":latest"
    if _REGISTRY_HOST.match(name):
        if registry == DEFAULT_REGISTRY or not name.startswith(DEFAULT_REGISTRY + "/"):
            return name
        name = name[len(DEFAULT_REGISTRY) + 1 :]
    return f"{registry}/{name}"


def swebench_image(instance_id: str, registry: str = DEFAULT_REGISTRY) -> str:
    """The image swebench pulls for an instance (Docker Hub allows no "__" in a name)."""
    return _image(f"swebench/sweb.eval.x86_64.{instance_id.replace('__', '_1776_')}", registry)


def swegym_image(instance_id: str, registry: str = DEFAULT_REGISTRY) -> str:
    """SWE-Gym's image of an instance, as OpenHands names it."""
    return _image(f"xingyaoww/sweb.eval.x86_64.{instance_id.replace('__', '_s_')}", registry)


def _evaluation(instance: dict[str, Any]) -> str:
    """How the instance is judged, or Refused."""
    if instance.get("eval_script"):
        if not instance.get("log_parser"):
            raise Refused("it carries an eval_script but no log_parser")
        return "instance"
    repo, version = instance["repo"], instance.get("version", "")
    if version in OFFICIAL_VERSIONS.get(repo, ()):
        return "official"
    tests = [*instance["FAIL_TO_PASS"], *instance["PASS_TO_PASS"]]
    not_pytest = [test for test in tests if not _PYTEST_ID.match(test)]
    if not not_pytest:
        return "pytest"
    known = (
        f"swebench defines no evaluation for {repo} version {version or '(none)'}"
        if repo in OFFICIAL_VERSIONS
        else f"swebench defines no evaluation for repository {repo}"
    )
    raise Refused(f"{known}, and {len(not_pytest)} of its tests are not pytest node ids (e.g. {not_pytest[0]!r})")


def _swe_bench_shaped(row: dict[str, Any], image: str, dataset: str) -> dict[str, Any]:
    instance_id = _text(row, "instance_id")
    base_commit = _text(row, "base_commit")
    if not _COMMIT.match(base_commit):
        raise Refused(f"base_commit {base_commit[:60]!r} is not a hex commit id")
    instance: dict[str, Any] = {
        "instance_id": instance_id,
        "repo": _text(row, "repo"),
        "version": _text(row, "version", required=False),
        "base_commit": base_commit,
        "problem_statement": _text(row, "problem_statement"),
        "test_patch": _text(row, "test_patch", required=False),
        "FAIL_TO_PASS": _tests(row, "FAIL_TO_PASS"),
        "PASS_TO_PASS": _tests(row, "PASS_TO_PASS"),
        "image": image,
        "dataset": dataset,
    }
    if not instance["FAIL_TO_PASS"]:
        raise Refused("FAIL_TO_PASS names no test: nothing tells a fix from no fix")
    for field in ("eval_script", "log_parser", "eval_type"):
        if row.get(field):
            instance[field] = _text(row, field)
    instance["evaluation"] = _evaluation(instance)
    return instance


def from_swe_bench(row: dict[str, Any], registry: str) -> dict[str, Any]:
    own = row.get("image") or row.get("docker_image")
    image = _image(str(own), registry) if own else swebench_image(_text(row, "instance_id"), registry)
    return _swe_bench_shaped(row, image, "swe-bench")


def from_swe_gym(row: dict[str, Any], registry: str) -> dict[str, Any]:
    own = row.get("image")
    image = _image(str(own), registry) if own else swegym_image(_text(row, "instance_id"), registry)
    return _swe_bench_shaped(row, image, "swe-gym")


def from_swe_smith(row: dict[str, Any], registry: str) -> dict[str, Any]:
    instance_id = _text(row, "instance_id")
    mirror = _text(row, "repo")
    image = _image(_text(row, "image_name"), registry)
    if not row.get("base_commit"):
        raise Refused(
            "no base_commit: SWE-smith keeps each bug on the branch "
            f"{instance_id!r} of github.com/swesmith/{mirror.split('/')[-1]}, not in its image; "
            "export rows with the commit of that branch, in an image that holds it"
        )
    owner_name = mirror.split("/")[-1].rsplit(".", 1)[0]
    repo = owner_name.replace("__", "/", 1) if "__" in owner_name else mirror
    shaped = {**row, "repo": repo, "version": ""}
    instance = _swe_bench_shaped(shaped, image, "swe-smith")
    instance["swesmith_repo"] = mirror
    return instance


def from_r2e_gym(row: dict[str, Any], registry: str) -> dict[str, Any]:
    if "instance_id" in row and "FAIL_TO_PASS" in row:  # R2E-Gym's SWE-bench-shaped sets
        return {**from_swe_bench(row, registry), "dataset": "r2e-gym"}
    _text(row, "docker_image")
    if not row.get("expected_output_json"):
        raise Refused("no expected_output_json and no FAIL_TO_PASS")
    raise Refused(
        "R2E-Gym grades a run by comparing every test's status with expected_output_json, over hidden "
        "tests in the image's /r2e_tests run by its run_tests.sh; it names no FAIL_TO_PASS and no base "
        "commit of /testbed, so it cannot be judged as a SWE-bench instance"
    )


CONVERTERS = {
    "swe-bench": from_swe_bench,
    "swe-gym": from_swe_gym,
    "swe-smith": from_swe_smith,
    "r2e-gym": from_r2e_gym,
}


def import_rows(rows: Iterable[Any], dataset: str, *, registry: str = DEFAULT_REGISTRY) -> Imported:
    """Task lines for the rows that can be judged; the others with their reason."""
    convert = CONVERTERS[dataset]
    tasks: list[dict[str, Any]] = []
    refused: list[tuple[str, str]] = []
    seen: set[str] = set()
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            refused.append((f"row {number}", "not a JSON object"))
            continue
        name = str(row.get("instance_id") or row.get("docker_image") or f"row {number}")
        try:
            instance = convert(row, registry)
            if instance["instance_id"] in seen:
                raise Refused("a second instance with this instance_id")
        except Refused as exc:
            refused.append((name, str(exc)))
            continue
        seen.add(instance["instance_id"])
        tasks.append({"id": instance["instance_id"], "handler": "swe", "instance": instance})
    return Imported(tasks, refused)


def write_tasks(tasks: Iterable[dict[str, Any]], out: TextIO) -> None:
    for task in tasks:
        out.write(json.dumps(task, ensure_ascii=False) + "\n")


def _refusals(refused: list[tuple[str, str]]) -> Iterator[str]:
    for name, reason in refused:
        yield f"refused {name}: {reason}"


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "import-swe", help="turn a SWE-bench / SWE-Gym / SWE-smith / R2E-Gym file into `prorl run` task lines"
    )
    parser.add_argument("file", type=Path, help="instances: .json, .jsonl or .parquet (needs pyarrow)")
    parser.add_argument("--format", choices=FORMATS, required=True, help="the dataset the file comes from")
    parser.add_argument("--out", type=Path, help="task lines to write (standard output without it)")
    parser.add_argument(
        "--registry",
        default=DEFAULT_REGISTRY,
        help=f"registry (or local prefix, e.g. localhost) of the images (default {DEFAULT_REGISTRY})",
    )


def command(args: argparse.Namespace) -> int:
    result = import_rows(read_rows(args.file), args.format, registry=args.registry)
    if args.out:
        with args.out.open("w") as out:
            write_tasks(result.tasks, out)
    else:
        write_tasks(result.tasks, sys.stdout)
    for line in _refusals(result.refused):
        print(line, file=sys.stderr)
    where = args.out or "standard output"
    print(f"{len(result.tasks)} tasks written to {where}, {len(result.refused)} instances refused", file=sys.stderr)
    return 0 if result.tasks or not result.refused else 1
