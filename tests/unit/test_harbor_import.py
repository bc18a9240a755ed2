"""`prorl import-harbor`: Harbor task folders as `terminal` task lines, on the shipped tasks
(sandbox_images/terminal/tasks) and on folders that must be refused, each with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prorl_client.harbor_import import (
    LOCAL_PYTHON,
    Refused,
    import_folders,
    pytest_files,
    translate_dockerfile,
    translate_run,
)
from prorl_client.runner import main

from prorl_server.agents.registry import default_registry
from prorl_server.config import load_settings

TASKS_DIR = Path(__file__).resolve().parents[2] / "sandbox_images" / "terminal" / "tasks"
SHIPPED = ("csv-region-totals", "fix-word-count", "hello-world")


def test_the_shipped_tasks_import_as_terminal_task_lines() -> None:
    imported = import_folders([TASKS_DIR])
    assert imported.refused == []
    assert [task["id"] for task in imported.tasks] == list(SHIPPED)
    handler = default_registry(plugins=False).get("terminal")
    settings = load_settings(None, environ={}, overrides={})
    for task in imported.tasks:
        instance = task["instance"]
        folder = TASKS_DIR / task["id"]
        assert task["handler"] == "terminal"
        assert instance["instruction"] == (folder / "instruction.md").read_text()
        assert instance["image"] == f"localhost/prorl-harbor-{task['id']}:latest"
        assert settings.sandbox.image_allowed(instance["image"])
        assert instance["workdir"] == "/app" and instance["test_files"] == ["test_outputs.py"]
        assert instance["tests"]["test_outputs.py"] == (folder / "tests" / "test_outputs.py").read_text()
        assert "solve.sh" not in json.dumps(instance)  # the reference solution never goes to the server
        assert instance["verifier_timeout_s"] == 120.0
        handler.validate(instance)  # the server takes it as it is
    words = import_folders([TASKS_DIR / "fix-word-count"]).tasks[0]["instance"]
    assert set(words["tests"]) == {"test.sh", "test_outputs.py", "data/hidden.txt"}
    assert words["agent_timeout_s"] == 600.0


def test_the_shipped_dockerfiles_translate_to_offline_builds() -> None:
    imported = import_folders([TASKS_DIR])
    hello = imported.environments["hello-world"]
    # FROM python:3.11-slim-bookworm; apt-get install git and pip install pytest are in the base.
    assert hello.containerfile.splitlines()[1] == f"FROM {LOCAL_PYTHON}"
    assert "apt-get" not in hello.containerfile and "pip" not in hello.containerfile
    assert any("pip install" in line for line in hello.dropped)
    words = imported.environments["fix-word-count"]  # FROM ubuntu:24.04
    lines = words.containerfile.splitlines()
    assert lines[1] == f"FROM {LOCAL_PYTHON}" and "COPY wordfreq.py /app/wordfreq.py" in lines
    assert "RUN chmod 0755 /app/wordfreq.py" in lines and lines[-1] == "WORKDIR /app"
    assert any(line.startswith("CMD") for line in words.dropped)
    # The sandbox's user owns the working directory, the tests folder and the logs folder.
    assert "chown -R 1000:1000 /app /tests /logs" in words.containerfile and "USER agent" in lines


def test_the_cli_writes_task_lines_and_build_contexts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tasks.jsonl"
    assert main(["import-harbor", str(TASKS_DIR), "--out", str(out), "--contexts", str(tmp_path / "ctx")]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == list(SHIPPED)
    context = tmp_path / "ctx" / "csv-region-totals"
    assert (context / "Containerfile").read_text().startswith("# Built offline")
    assert (context / "sales.csv").read_text() == (TASKS_DIR / "csv-region-totals/environment/sales.csv").read_text()
    assert "3 tasks written" in capsys.readouterr().err


def write_task(root: Path, *, dockerfile: str = "FROM python:3.12\nWORKDIR /app\n", **files: str) -> Path:
    folder = root / "task"
    defaults = {
        "task.toml": "[verifier]\ntimeout_sec = 30\n[agent]\ntimeout_sec = 60\n",
        "instruction.md": "Do it.\n",
        "tests/test.sh": "#!/bin/bash\npytest /tests/test_state.py -rA && echo 1 > /logs/verifier/reward.txt\n",
        "tests/test_state.py": "def test_x():\n    assert True\n",
        "environment/Dockerfile": dockerfile,
    }
    for name, text in {**defaults, **files}.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if text:
            path.write_text(text)
    return folder


def refusal(folder: Path, **options: dict[str, str]) -> str:
    imported = import_folders([folder], **options)
    assert imported.tasks == [], imported.tasks
    ((_, reason),) = imported.refused
    return reason


@pytest.mark.parametrize(
    ("dockerfile", "expected"),
    [
        ("FROM alpine:3.20\n", "base image 'alpine:3.20' has no local counterpart"),
        ("FROM python:3.12\nRUN apt-get update && apt-get install -y curl jq\n", "installs curl, jq with apt-get"),
        ("FROM python:3.12\nRUN pip install numpy==2.1 pytest\n", "pip-installs numpy"),
        ("FROM python:3.12\nRUN pip install -r requirements.txt\n", "pip-installs from a file"),
        ("FROM python:3.12\nRUN curl -LsSf https://astral.sh/uv/install.sh | sh\n", "needs the network"),
        ("FROM python:3.12\nADD https://example.com/x.tgz /app/\n", "ADD of a URL"),
        ("FROM python:3.12\nCOPY missing.txt /app/\n", "'missing.txt', which is not in its environment folder"),
        ("FROM python:3.12 AS build\nFROM debian:bookworm\n", "more than one stage"),
        ("FROM python:3.12\nUSER app\n", "switches to user 'app'"),
        ("FROM python:3.12\nONBUILD RUN true\n", "not translated: ONBUILD"),
    ],
)
def test_an_environment_that_cannot_be_built_offline_is_refused(tmp_path: Path, dockerfile: str, expected: str) -> None:
    assert expected in refusal(write_task(tmp_path, dockerfile=dockerfile))


def test_a_base_image_can_be_mapped_and_a_preloaded_image_named(tmp_path: Path) -> None:
    folder = write_task(tmp_path, dockerfile="FROM alpine:3.20\nWORKDIR /srv/work\n")
    imported = import_folders([folder], base_images={"alpine": "localhost/prorl-python:latest"})
    assert imported.tasks[0]["instance"]["workdir"] == "/srv/work"
    preloaded = write_task(tmp_path / "other", **{"task.toml": '[environment]\ndocker_image = "ghcr.io/org/env:1"\n'})
    imported = import_folders([preloaded], images={"ghcr.io/org/env:1": "localhost/prorl-harbor-env:latest"})
    (task,) = imported.tasks
    assert task["instance"]["image"] == "localhost/prorl-harbor-env:latest"
    assert imported.environments[task["id"]].context is None  # nothing to build


def test_tests_that_only_write_a_reward_file_are_refused(tmp_path: Path) -> None:
    script = "#!/bin/bash\n[ -f /app/out ] && echo 1 > /logs/verifier/reward.txt\n"
    folder = write_task(tmp_path, **{"tests/test.sh": script})
    assert "does not run pytest" in refusal(folder)


def test_other_refusals_name_their_reason(tmp_path: Path) -> None:
    binary = write_task(tmp_path / "a")
    (binary / "tests" / "blob.bin").write_bytes(b"\xff\xfe\x00")
    assert "tests/blob.bin is not UTF-8 text" in refusal(binary)
    no_instruction = write_task(tmp_path / "b")
    (no_instruction / "instruction.md").unlink()
    assert refusal(no_instruction) == "it has no instruction.md"
    inside = write_task(tmp_path / "c", dockerfile="FROM python:3.12\nWORKDIR /tests\n")
    assert "inside the tests folder" in refusal(inside)
    nothing = write_task(tmp_path / "d", dockerfile="")
    assert "neither environment/Dockerfile nor [environment] docker_image" in refusal(nothing)


def test_the_pytest_files_are_those_test_sh_names() -> None:
    tests = {"test.sh": "", "test_outputs.py": "", "helpers.py": "", "test_extra.py": ""}
    uvx = "uvx -p 3.13 -w pytest==8.4.1 pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA"
    assert pytest_files(uvx, tests) == ["test_outputs.py"]
    assert pytest_files('pytest "$TEST_DIR/test_extra.py" -v', tests) == ["test_extra.py"]
    assert pytest_files("cd /tests && python -m pytest -rA", tests) == ["test_extra.py", "test_outputs.py"]
    with pytest.raises(Refused, match="does not run pytest"):
        pytest_files("bash /tests/check.sh", tests)


def test_run_lines_keep_local_commands_and_drop_what_the_base_has() -> None:
    kept, dropped = translate_run("apt-get update && apt-get install -y python3 git && mkdir -p /app/data; echo hi")
    assert kept == ["mkdir -p /app/data", "echo hi"]
    assert dropped == ["apt-get update", "apt-get install -y python3 git"]
    environment = translate_dockerfile("FROM debian:bookworm\nENV A=1\n", environment_dir=Path("."), base_images={})
    assert "ENV A=1" in environment.containerfile.splitlines()
