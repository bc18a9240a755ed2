"""`prorl import-swe`: SWE-bench / SWE-Gym / SWE-smith / R2E-Gym files into `prorl run` task lines,
on the samples in tests/data/swe_datasets (see its README)."""

from __future__ import annotations

import builtins
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from prorl_client import runner, swe_import
from prorl_server.agents.swe import SWEInstance
from prorl_server.verifiers.swebench import specs

Refused, import_rows, read_rows = swe_import.Refused, swe_import.import_rows, swe_import.read_rows

DATA = Path(__file__).resolve().parents[2] / "data" / "swe_datasets"


def imported(name: str, dataset: str, **options: Any) -> swe_import.Imported:
    return import_rows(read_rows(DATA / name), dataset, **options)


def by_id(result: swe_import.Imported) -> dict[str, dict[str, Any]]:
    return {task["id"]: task["instance"] for task in result.tasks}


def test_swe_bench_rows() -> None:
    result = imported("swe-bench.jsonl", "swe-bench")
    tasks = by_id(result)
    assert sorted(tasks) == [
        "astropy__astropy-12907",
        "django__django-11099",
        "psf__requests-2317",
        "sympy__sympy-20590",
    ]
    django = tasks["django__django-11099"]
    assert django["image"] == "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert django["FAIL_TO_PASS"] == [
        "test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)",
        "test_unicode_validator (auth_tests.test_validators.UsernameValidatorsTests)",
    ]
    assert django["evaluation"] == "official" and django["version"] == "3.0"
    assert "patch" not in django and "hints_text" not in django  # the gold patch stays out
    assert tasks["sympy__sympy-20590"]["evaluation"] == "official"
    assert tasks["astropy__astropy-12907"]["evaluation"] == "official"
    own = tasks["psf__requests-2317"]
    assert own["evaluation"] == "instance"
    assert own["image"] == "docker.io/swebench/sweb.eval.x86_64.psf_1776_requests-2317:latest"
    assert own["log_parser"] == "parse_log_requests" and own["eval_script"].startswith("#!/bin/bash")
    assert dict(result.refused) == {
        "django__django-15127": "FAIL_TO_PASS names no test: nothing tells a fix from no fix",
        "django__django-5470": "swebench defines no evaluation for django/django version 1.3, and 1 of its tests "
        "are not pytest node ids (e.g. 'test_setup_script_prefix (user_commands.tests.CommandTests)')",
    }
    assert [task["handler"] for task in result.tasks] == ["swe"] * 4


def test_swe_gym_rows() -> None:
    result = imported("swe-gym.json", "swe-gym")
    tasks = by_id(result)
    assert sorted(tasks) == ["getmoto__moto-7365", "pandas-dev__pandas-53672", "python__mypy-11204"]
    moto = tasks["getmoto__moto-7365"]
    assert moto["image"] == "docker.io/xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365:latest"
    assert moto["evaluation"] == "pytest" and moto["dataset"] == "swe-gym"
    assert moto["FAIL_TO_PASS"] == [
        "tests/test_dynamodb/test_dynamodb_update_expressions.py::test_update_item_add_float"
    ]
    [(name, reason)] = result.refused
    assert name == "conan-io__conan-13403"
    assert reason.startswith("swebench defines no evaluation for repository conan-io/conan")


def test_swe_smith_rows() -> None:
    result = imported("swe-smith.json", "swe-smith")
    [task] = result.tasks
    instance = task["instance"]
    assert instance["repo"] == "oauthlib/oauthlib"
    assert instance["swesmith_repo"] == "swesmith/oauthlib__oauthlib.1fd52536"
    assert instance["image"] == "docker.io/jyangballin/swesmith.x86_64.oauthlib_1776_oauthlib.1fd52536:latest"
    assert instance["evaluation"] == "pytest"
    [(name, reason)] = result.refused
    assert name == "pydantic__pydantic.acb0f10f.pr_8316"
    assert "no base_commit" in reason and "github.com/swesmith/pydantic__pydantic.acb0f10f" in reason


def test_r2e_gym_rows() -> None:
    result = imported("r2e-gym.jsonl", "r2e-gym")
    [task] = result.tasks
    assert task["instance"]["image"] == "docker.io/namanjain12/django_final:d26b2424437dabeeca94d7900b37d2df4410da0c"
    assert task["instance"]["dataset"] == "r2e-gym" and task["instance"]["evaluation"] == "official"
    reasons = dict(result.refused)
    assert "expected_output_json" in reasons["namanjain12/aiohttp_final:f0d74880deec8fcd982bce639c93c5e130d41198"]
    assert reasons["namanjain12/pillow_final:4a3a1a7b8e3a59c2e36b24e6e0bff2e7d4c0d4e2"] == (
        "no expected_output_json and no FAIL_TO_PASS"
    )


@pytest.mark.parametrize(
    ("name", "dataset"),
    [("swe-bench.jsonl", "swe-bench"), ("swe-gym.json", "swe-gym"), ("swe-smith.json", "swe-smith")],
)
def test_every_task_is_a_valid_swe_instance_for_the_server(name: str, dataset: str) -> None:
    """Valid, except those whose official runner is neither pytest nor Django's or SymPy's
    (tox, ...): the server refuses them."""
    for task in imported(name, dataset).tasks:
        fields = task["instance"]
        spec = specs.spec_for(fields) if fields["evaluation"] in ("official", "instance") else None
        if spec is not None and spec.runner not in ("pytest", "django", "sympy"):
            with pytest.raises(ValidationError, match="this server judges django, pytest, sympy runs only"):
                SWEInstance.model_validate(fields)
            continue
        assert fields["FAIL_TO_PASS"] == SWEInstance.model_validate(fields).FAIL_TO_PASS


def test_the_client_knows_the_official_versions_the_server_knows() -> None:
    server = {repo: set(versions) for repo, versions in specs.known_versions().items()}
    with_command = {
        repo: {version for version in versions if _has_test_cmd(repo, version)} for repo, versions in server.items()
    }
    assert {repo: versions for repo, versions in with_command.items() if versions} == swe_import.OFFICIAL_VERSIONS


def _has_test_cmd(repo: str, version: str) -> bool:
    try:
        specs.official_spec(repo, version)
    except specs.UnknownSpec:
        return False
    return True


def test_registry_and_image_names() -> None:
    assert swe_import.swebench_image("django__django-11099", "localhost") == (
        "localhost/swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    )
    assert swe_import.swegym_image("Project-MONAI__MONAI-5932") == (
        "docker.io/xingyaoww/sweb.eval.x86_64.project-monai_s_monai-5932:latest"
    )
    local = by_id(imported("swe-bench.jsonl", "swe-bench", registry="localhost"))
    assert local["psf__requests-2317"]["image"] == "localhost/swebench/sweb.eval.x86_64.psf_1776_requests-2317:latest"
    assert swe_import._image("quay.io/x/y:1", "localhost") == "quay.io/x/y:1"
    assert swe_import._image("docker.io/x/y", "localhost") == "localhost/x/y:latest"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"FAIL_TO_PASS": "not json"}, "FAIL_TO_PASS is a string but not a JSON list"),
        ({"FAIL_TO_PASS": json.dumps([1])}, "FAIL_TO_PASS is not a list of test names"),
        ({"base_commit": "main"}, "base_commit 'main' is not a hex commit id"),
        ({"problem_statement": ""}, "no problem_statement"),
        ({"eval_script": "pytest", "log_parser": None}, "it carries an eval_script but no log_parser"),
    ],
)
def test_malformed_rows_are_refused_with_their_reason(change: dict[str, Any], reason: str) -> None:
    row = read_rows(DATA / "swe-bench.jsonl")[0]
    with pytest.raises(Refused, match=reason):
        swe_import.from_swe_bench({**row, **change}, "docker.io")


def test_a_repeated_instance_is_refused() -> None:
    row = read_rows(DATA / "swe-bench.jsonl")[0]
    result = import_rows([row, row, "not a row"], "swe-bench")
    assert len(result.tasks) == 1
    assert result.refused == [
        ("django__django-11099", "a second instance with this instance_id"),
        ("row 3", "not a JSON object"),
    ]


def test_the_command_writes_task_lines_for_prorl_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tasks.jsonl"
    code = runner.main(["import-swe", str(DATA / "swe-bench.jsonl"), "--format", "swe-bench", "--out", str(out)])
    assert code == 0
    errors = capsys.readouterr().err
    assert "refused django__django-15127: FAIL_TO_PASS names no test" in errors
    assert f"4 tasks written to {out}, 2 instances refused" in errors
    tasks = runner.load_tasks(out, "math")
    assert [task["handler"] for task in tasks] == ["swe"] * 4
    request = runner.build_request(tasks[0], 0, "run")
    assert request.handler == "swe" and request.instance["instance_id"] == tasks[0]["id"]


def test_nothing_importable_fails_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = runner.main(
        ["import-swe", str(DATA / "r2e-gym.jsonl"), "--format", "swe-smith", "--out", str(tmp_path / "o")]
    )
    assert code == 1
    assert "0 tasks written" in capsys.readouterr().err


def test_parquet_without_pyarrow_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_pyarrow(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(SystemExit, match=r"reading Parquet needs pyarrow \(pip install pyarrow\)"):
        read_rows(tmp_path / "train.parquet")


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow is not installed")
def test_parquet_rows_import_like_json(tmp_path: Path) -> None:
    import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]
    import pyarrow.parquet as pq  # type: ignore[import-not-found,import-untyped,unused-ignore]

    rows = read_rows(DATA / "swe-gym.json")
    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert import_rows(read_rows(path), "swe-gym") == import_rows(rows, "swe-gym")


def test_the_client_module_does_not_import_the_server() -> None:
    source = Path(swe_import.__file__).read_text()
    assert "prorl_server" not in source.replace("prorl_server/verifiers/swebench/specs.json", "")
