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

TASKS_DIR = Path(__file__).resolve().parents[3] / "sandbox_images" / "terminal" / "tasks"
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


# --- task.toml's limits (prorl_client/harbor_limits.py) ------------------------------------------


def imported_instance(tmp_path: Path, toml: str, **options: bool) -> dict[str, object]:
    imported = import_folders([write_task(tmp_path, **{"task.toml": toml})], **options)  # type: ignore[arg-type]
    assert imported.refused == [], imported.refused
    return dict(imported.tasks[0]["instance"])


def test_the_shipped_tasks_carry_their_limits() -> None:
    instances = {task["id"]: task["instance"] for task in import_folders([TASKS_DIR]).tasks}
    assert {name: instance["agent_timeout_s"] for name, instance in instances.items()} == {
        "csv-region-totals": 300.0,
        "fix-word-count": 600.0,
        "hello-world": 120.0,
    }
    for instance in instances.values():
        assert (instance["cpus"], instance["memory_mib"], instance["verifier_timeout_s"]) == (1, 1024, 120.0)
        assert "storage_mib" not in instance  # none of them sets it


def test_limits_in_harbors_spellings(tmp_path: Path) -> None:
    toml = (
        "[agent]\ntimeout_sec = 45\n[verifier]\ntimeout_sec = 90.5\n"
        '[environment]\ncpus = 2\nmemory = "2G"\nstorage = "10G"\nbuild_timeout_sec = 600.0\n'
        'network_mode = "no-network"\ngpus = 0\nos = "Linux"\nworkdir = "/srv/app"\n'
    )
    instance = imported_instance(tmp_path / "a", toml)
    assert (instance["agent_timeout_s"], instance["verifier_timeout_s"]) == (45.0, 90.5)
    assert (instance["cpus"], instance["memory_mib"], instance["storage_mib"]) == (2, 2048, 10240)
    assert instance["workdir"] == "/srv/app"  # [environment] workdir wins over the Dockerfile's
    handler = default_registry(plugins=False).get("terminal")
    handler.validate(instance)
    # Nothing set: Harbor's default verifier time, no agent timeout, no resources.
    bare = imported_instance(tmp_path / "b", "# no limits\n")
    assert (bare["agent_timeout_s"], bare["verifier_timeout_s"]) == (0.0, 600.0)
    assert not {"cpus", "memory_mib", "storage_mib"} & set(bare)
    same = imported_instance(tmp_path / "c", '[environment]\nmemory = "512M"\nmemory_mb = 512\n')
    assert same["memory_mib"] == 512


def test_a_workdir_from_task_toml_is_the_agents_in_the_built_image(tmp_path: Path) -> None:
    folder = write_task(tmp_path, **{"task.toml": '[environment]\nworkdir = "/srv/app"\n'})
    environment = next(iter(import_folders([folder]).environments.values()))
    lines = environment.containerfile.splitlines()
    assert lines[-1] == "WORKDIR /srv/app" and "chown -R 1000:1000 /srv/app /tests /logs" in environment.containerfile


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[agent]\ntimeout_sec = -5\n", "[agent] timeout_sec = -5 is not a positive number of seconds"),
        ('[agent]\ntimeout_sec = "soon"\n', "[agent] timeout_sec = 'soon' is not a positive number"),
        ("[agent]\ntimeout_sec = inf\n", "[agent] timeout_sec = inf is not a positive number"),
        ("[agent]\ntimeout_sec = nan\n", "[agent] timeout_sec = nan is not a positive number"),
        ("[agent]\ntimeout_sec = true\n", "[agent] timeout_sec = True is not a positive number"),
        ("[agent]\ntimeout_sec = 100000\n", "is over 86400 s, the most a terminal task may set"),
        ("[verifier]\ntimeout_sec = 7200\n", "[verifier] timeout_sec = 7200 is over 3600 s"),
        ("[environment]\ncpus = 1.5\n", "[environment] cpus = 1.5 is not a whole number of at least 1"),
        ('[environment]\ncpus = "two"\n', "[environment] cpus = 'two' is not a whole number"),
        ("[environment]\ncpus = 0\n", "[environment] cpus = 0 is not a whole number of at least 1"),
        ("[environment]\nmemory_mb = 8\n", "[environment] memory_mb = 8 is not a whole number of at least 16"),
        ('[environment]\nmemory = "lots"\n', "[environment] memory = 'lots' is not a size such as \"4G\""),
        ('[environment]\nmemory = "4GB"\n', "[environment] memory = '4GB' is not a size"),
        ('[environment]\nmemory = "1G"\nmemory_mb = 2048\n', "memory = '1G' and memory_mb = 2048 disagree"),
        ('[environment]\nstorage = "-1G"\n', "[environment] storage = '-1G' is not a size"),
        ('[environment]\nallow_internet = "yes"\n', "allow_internet = 'yes' is not true or false"),
        ('[environment]\nnetwork_mode = "sometimes"\n', "network_mode = 'sometimes' is not one of public"),
        ('[agent]\nallowed_hosts = "pypi.org"\n', "[agent] allowed_hosts = 'pypi.org' is not a list of host names"),
        ("[environment]\ndisk_quota = 10\n", "[environment] sets disk_quota, which this importer does not know"),
        ("[agent]\nmax_steps = 10\nturns = 2\n", "[agent] sets max_steps, turns, which this importer does not know"),
        ("[verifier]\nretries = 3\n", "[verifier] sets retries, which this importer does not know"),
        ('environment = "big"\n', "its task.toml's environment is not a table"),
        ('[environment]\nworkdir = "app"\n', "[environment] workdir = 'app' is not an absolute path"),
        ("[environment]\nbuild_timeout_sec = -1\n", "[environment] build_timeout_sec = -1 is not a positive number"),
        ('[agent]\nsetup_timeout_sec = "x"\n', "[agent] setup_timeout_sec = 'x' is not a positive number"),
    ],
)
def test_unknown_or_malformed_limits_are_refused(tmp_path: Path, toml: str, expected: str) -> None:
    assert expected in refusal(write_task(tmp_path, **{"task.toml": toml}))


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[environment]\ngpus = 1\n", "[environment] gpus = 1: the sandboxes here have no GPU"),
        ('[environment]\ntpu = { type = "v6e", topology = "2x4" }\n', "asks for a TPU"),
        ('[environment]\nos = "windows"\n', "[environment] os = 'windows': the sandboxes here are Linux"),
        ('[agent]\nuser = "root"\n', "[agent] user = 'root': it runs the agent as that user"),
        ("[verifier]\nuser = 0\n", "[verifier] user = 0: it runs the tests as that user"),
        ('[environment]\nenv = { API_KEY = "${API_KEY}" }\n', "takes variables from the host"),
        ('[verifier]\nenv = { MODE = "strict" }\n', "[verifier] env sets variables for the tests"),
        ('[[environment.mcp_servers]]\nname = "x"\nurl = "http://x"\n', "mcp_servers gives the agent MCP servers"),
        ('[environment.healthcheck]\ncommand = "curl localhost"\n', "healthcheck waits for a service"),
        ('[[verifier.collect]]\ncommand = "cp a b"\n', "[[verifier.collect]] runs hooks after the agent"),
        ('[verifier.environment]\ndocker_image = "x"\n', "defines an environment of the tests' own"),
        ('[[steps]]\nname = "one"\n', "it is a multi-step task"),
    ],
)
def test_what_the_sandboxes_cannot_give_is_refused(tmp_path: Path, toml: str, expected: str) -> None:
    assert expected in refusal(write_task(tmp_path, **{"task.toml": toml}))


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ("[environment]\nallow_internet = true\n", "[environment] allow_internet = true"),
        ('[environment]\nnetwork_mode = "public"\n', "[environment] network_mode = 'public'"),
        # A phase's own mode overrides the environment's.
        ('[environment]\nnetwork_mode = "no-network"\n[agent]\nnetwork_mode = "public"\n', "[agent] network_mode"),
        ('[verifier]\nnetwork_mode = "public"\n', "[verifier] network_mode = 'public'"),
        ('[agent]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org"]\n', "[agent] allowed_hosts = ['pypi.org']"),
    ],
)
def test_a_task_given_the_internet_is_refused_unless_the_operator_says_so(
    tmp_path: Path, toml: str, field: str
) -> None:
    reason = refusal(write_task(tmp_path / "a", **{"task.toml": toml}))
    assert f"gives it network access ({field}" in reason and "the sandboxes here have none" in reason
    assert "--no-internet-ok" in reason
    imported_instance(tmp_path / "b", toml, internet_ok=True)  # the operator's word: it runs without


def test_no_network_or_no_word_about_it_is_imported(tmp_path: Path) -> None:
    imported_instance(tmp_path / "a", "[environment]\nallow_internet = false\n")
    # network_mode is Harbor's newer field, and wins over the older boolean.
    imported_instance(tmp_path / "b", '[environment]\nallow_internet = true\nnetwork_mode = "no-network"\n')
    imported_instance(tmp_path / "c", "[environment]\ncpus = 1\n")  # Harbor's default allows it; none is needed


def test_the_sandboxes_own_user_may_be_named(tmp_path: Path) -> None:
    imported_instance(tmp_path / "a", '[agent]\nuser = "agent"\n[verifier]\nuser = 1000\n')


def test_the_cli_imports_a_task_given_the_internet_only_when_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_task(tmp_path, **{"task.toml": "[environment]\nallow_internet = true\n"})
    out = tmp_path / "tasks.jsonl"
    assert main(["import-harbor", str(folder), "--out", str(out)]) == 1
    assert "allow_internet = true" in capsys.readouterr().err and out.read_text() == ""
    assert main(["import-harbor", str(folder), "--out", str(out), "--no-internet-ok"]) == 0
    assert len(out.read_text().splitlines()) == 1
