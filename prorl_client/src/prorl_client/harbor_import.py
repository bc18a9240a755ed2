"""`prorl import-harbor DIR... --out TASKS.jsonl`: Harbor / Terminal-Bench task folders as `terminal` task lines.

A Harbor task folder holds `task.toml` (time limits, environment), `instruction.md`
(what the agent is told), `environment/Dockerfile` (or `[environment]
docker_image`), `tests/test.sh` with the test files it runs, and optionally
`solution/solve.sh` (the reference solution, never imported). DIR is one task
folder or a folder of them.

Each task becomes {"id": name, "handler": "terminal", "instance": {...}} with
the instruction, the files of tests/ (text), the pytest files test.sh runs
(`test_files`), the Dockerfile's WORKDIR (default /app; [environment] workdir
over it), the time limits and resources of its task.toml (checked by
prorl_client.harbor_limits, which the server then enforces), and the image. A
task is refused, with its reason on standard error, when:
- its task.toml sets a limit that is unknown or malformed, or asks for what the
  sandboxes here do not have (network, GPUs, ...: see harbor_limits);
- test.sh runs no pytest file of tests/ (a script that only writes a reward
  file cannot be judged: the terminal family reads each test's outcome from its
  own reporter, never a reward file or printed output);
- a file of tests/ is not UTF-8 text, or instruction.md is missing;
- its environment cannot be had offline (below).

Environment:
- `[environment] docker_image` names an image the operator pre-loaded (podman
  load / tag, within the server's sandbox.allowed_images); `--image OLD=NEW`
  renames it.
- Otherwise environment/Dockerfile is translated into a Containerfile built
  FROM a local image with no network: its FROM must map to a local base
  (python, debian, ubuntu and Terminal-Bench's own python/ubuntu bases map to
  localhost/prorl-python:latest, Debian bookworm with python3, git and pytest;
  `--base-image NAME=LOCAL` adds one). WORKDIR, ENV, COPY/ADD of files from the
  environment folder, and RUN lines of local commands are kept; in a RUN line,
  `apt-get install` and `pip install` of what the local base already holds
  (pytest, git, python3, ...) are dropped, `apt-get update`/`clean` too, and
  anything else fetching from a network (other packages, curl, wget, git
  clone, a URL) refuses the task, naming it. The build context goes to
  `--contexts DIR/<image name>/`; `--build` builds it with podman (network
  none), or build it yourself: `podman build --network none --pull-never -t
  TAG CONTEXT`. The image is `localhost/prorl-harbor-<name>:latest`.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from prorl_client.harbor_limits import Refused, read_limits

try:
    import tomllib
except ModuleNotFoundError:  # python 3.10: its backport
    import tomli as tomllib  # type: ignore[no-redef,import-not-found]

LOCAL_PYTHON = "localhost/prorl-python:latest"
# Base images whose tasks run on the local Debian bookworm image with python3 (by name, any tag).
BASE_IMAGES = {
    "python": LOCAL_PYTHON,
    "debian": LOCAL_PYTHON,
    "ubuntu": LOCAL_PYTHON,
    "ghcr.io/laude-institute/t-bench/python-3-13": LOCAL_PYTHON,
    "ghcr.io/laude-institute/t-bench/ubuntu-24-04": LOCAL_PYTHON,
}
# What the local base image holds (scripts/build_images.sh: debootstrap minbase + python3, git,
# python3-pytest): installing them again is a no-op, and the build has no network for anything else.
LOCAL_DEBIAN_PACKAGES = frozenset(
    {
        "python3", "python3-minimal", "python-is-python3", "git", "python3-pytest", "bash", "coreutils",
        "tar", "gzip", "findutils", "grep", "sed", "diffutils", "procps", "ca-certificates",
    }
)  # fmt: skip
LOCAL_PIP_PACKAGES = frozenset({"pytest", "pluggy", "iniconfig", "packaging"})
DEFAULT_WORKDIR = "/app"
_NETWORK = re.compile(r"\b(curl|wget|git\s+clone|uv\s+(?:pip|add|sync|tool)|uvx|npm|conda)\b|https?://")
_PYTEST_FILE = re.compile(r"([\w./${}:-]*?)([\w.-]+(?:/[\w.-]+)*\.py)\b")


@dataclass
class Environment:
    image: str
    containerfile: str = ""
    """Empty for an image the operator pre-loaded."""
    workdir: str = DEFAULT_WORKDIR
    context: Path | None = None
    """The environment folder (the build context's files)."""
    dropped: list[str] = field(default_factory=list)


@dataclass
class Imported:
    tasks: list[dict[str, Any]]
    refused: list[tuple[str, str]]
    environments: dict[str, Environment]
    """By task id: how each task's image is built (or that it is pre-loaded)."""


def slug(name: str) -> str:
    text = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.")
    return text or "task"


def image_name(name: str) -> str:
    return f"localhost/prorl-harbor-{slug(name)}:latest"


def task_folders(paths: Iterable[Path]) -> list[Path]:
    """Each path if it is a task folder (holds task.toml), else the task folders inside it."""
    found: list[Path] = []
    for path in paths:
        if (path / "task.toml").is_file():
            found.append(path)
        else:
            found.extend(sorted(child.parent for child in path.glob("*/task.toml")))
    return found


def _logical_lines(text: str) -> list[str]:
    """A Dockerfile's instructions: comments dropped, continuation lines joined."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append((current + stripped).strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    return lines


def map_base(image: str, extra: dict[str, str]) -> str:
    name = image.split("@", 1)[0]
    repository = name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name
    for key in (image, name, repository, repository.removeprefix("docker.io/").removeprefix("library/")):
        if key in extra:
            return extra[key]
        if key in BASE_IMAGES:
            return BASE_IMAGES[key]
    raise Refused(
        f"its base image {image!r} has no local counterpart (the build has no network): map it with "
        f"--base-image {repository}=LOCAL_IMAGE, or pre-load an image and name it in [environment] docker_image"
    )


def _packages(words: list[str]) -> list[str]:
    """The arguments of an install command that are not options."""
    return [word for word in words if not word.startswith("-")]


def translate_run(command: str) -> tuple[list[str], list[str]]:
    """A RUN line's commands to keep and those dropped as already satisfied; Refused otherwise."""
    kept, dropped = [], []
    for part in (piece.strip() for piece in re.split(r"&&|;", command)):
        if not part:
            continue
        words = shlex.split(part, posix=True) if part else []
        head = [word for word in words if word != "sudo"]
        while head and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", head[0]):  # VAR=value before the command
            head.pop(0)
        if head[:1] in (["apt-get"], ["apt"]):
            verb = next((word for word in head[1:] if not word.startswith("-")), "")
            if verb in ("update", "clean", "autoremove", "autoclean"):
                dropped.append(part)
                continue
            if verb == "install":
                packages = [p.split("=")[0] for p in _packages(head[1:]) if p != "install"]
                missing = [p for p in packages if p not in LOCAL_DEBIAN_PACKAGES]
                if missing:
                    raise Refused(
                        f"its Dockerfile installs {', '.join(missing)} with apt-get: the local base image lacks "
                        "them and the build has no network (pre-load an image that has them)"
                    )
                dropped.append(part)
                continue
            raise Refused(f"its Dockerfile runs {part!r}: only apt-get install, update and clean are understood")
        if head[:1] in (["pip"], ["pip3"]) or head[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
            rest = head[head.index("install") + 1 :] if "install" in head else None
            if rest is None:
                raise Refused(f"its Dockerfile runs {part!r}: only pip install is understood")
            if any(word in ("-r", "--requirement", "-e", "--editable", ".") for word in rest):
                raise Refused(f"its Dockerfile pip-installs from a file or folder ({part!r}): the build has no network")
            packages = [re.split(r"[=<>!~\[ ]", p, maxsplit=1)[0].lower() for p in _packages(rest)]
            missing = [p for p in packages if p not in LOCAL_PIP_PACKAGES]
            if missing:
                raise Refused(
                    f"its Dockerfile pip-installs {', '.join(missing)}: the local base image lacks them and the "
                    "build has no network (pre-load an image that has them)"
                )
            dropped.append(part)
            continue
        if _NETWORK.search(part):
            raise Refused(f"its Dockerfile runs {part!r}, which needs the network (the build has none)")
        if part.startswith("rm -rf /var/lib/apt/lists"):
            dropped.append(part)
            continue
        kept.append(part)
    return kept, dropped


def translate_dockerfile(
    text: str, *, environment_dir: Path, base_images: dict[str, str], workdir_override: str | None = None
) -> Environment:
    """The Containerfile that builds a Dockerfile's environment offline (or Refused, saying why);
    `workdir_override` (task.toml's [environment] workdir) is where the agent works, over WORKDIR."""
    body: list[str] = []
    dropped: list[str] = []
    base = ""
    workdir = DEFAULT_WORKDIR
    for line in _logical_lines(text):
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), rest.strip()
        if instruction == "FROM":
            if base:
                raise Refused("its Dockerfile has more than one stage (FROM); only single-stage builds are translated")
            words = [word for word in rest.split() if not word.startswith("--")]
            base = map_base(words[0], base_images)
        elif instruction == "WORKDIR":
            workdir = rest if rest.startswith("/") else f"{workdir.rstrip('/')}/{rest}"
            body.append(f"WORKDIR {workdir}")
        elif instruction in ("ENV", "ARG", "LABEL"):
            body.append(line)
        elif instruction in ("COPY", "ADD"):
            words = shlex.split(rest)
            if any(word.startswith("--from") for word in words):
                raise Refused("its Dockerfile copies from another stage or image (COPY --from)")
            sources = [word for word in words if not word.startswith("--")][:-1]
            for source in sources:
                if "://" in source:
                    raise Refused(f"its Dockerfile fetches {source!r} (ADD of a URL): the build has no network")
                resolved = (environment_dir / source).resolve()
                if not resolved.is_relative_to(environment_dir.resolve()) or not resolved.exists():
                    raise Refused(f"its Dockerfile copies {source!r}, which is not in its environment folder")
            options = [word for word in words if word.startswith("--") and not word.startswith("--chown")]
            body.append(
                " ".join(["COPY", *options, *[shlex.quote(word) for word in words if not word.startswith("--")]])
            )
        elif instruction == "RUN":
            if rest.startswith("--") or rest.startswith("["):
                raise Refused(f"its Dockerfile has a RUN form that is not translated: {line[:120]!r}")
            kept, gone = translate_run(rest)
            dropped += gone
            if kept:
                body.append("RUN " + " && ".join(kept))
        elif instruction in ("CMD", "ENTRYPOINT", "EXPOSE", "HEALTHCHECK", "STOPSIGNAL", "VOLUME", "SHELL"):
            dropped.append(line)  # the sandbox runs its own runtime, with no network and no volumes
        elif instruction == "USER":
            if rest not in ("root", "0"):
                raise Refused(f"its Dockerfile switches to user {rest!r}; the sandbox's user is agent (uid 1000)")
        else:
            raise Refused(f"its Dockerfile has an instruction that is not translated: {instruction}")
    if not base:
        raise Refused("its Dockerfile has no FROM")
    workdir = workdir_override or workdir
    owned = " ".join(shlex.quote(path) for path in (workdir, "/tests", "/logs"))
    containerfile = "\n".join(
        [
            "# Built offline by `prorl import-harbor` from the task's environment/Dockerfile.",
            f"FROM {base}",
            "USER root",
            *body,
            # The sandbox runs as the image's user (agent): its working directory, the tests
            # folder and Harbor's logs folder are its own.
            f"RUN mkdir -p {owned} /logs/verifier && chown -R 1000:1000 {owned}",
            "USER agent",
            f"WORKDIR {workdir}",
            "",
        ]
    )
    return Environment(image="", containerfile=containerfile, workdir=workdir, context=environment_dir, dropped=dropped)


def pytest_files(test_sh: str, tests: dict[str, str]) -> list[str]:
    """The files of tests/ that test.sh runs with pytest (Refused if it runs none)."""
    if "pytest" not in test_sh:
        raise Refused(
            "its tests/test.sh does not run pytest: the terminal family judges a task by its pytest files' "
            "outcomes, never by a reward file or printed output"
        )
    named: list[str] = []
    for line in test_sh.splitlines():
        if "pytest" not in line.split("#", 1)[0]:
            continue
        for match in _PYTEST_FILE.finditer(line.split("#", 1)[0]):
            path = match.group(2)
            for candidate in (path, path.split("/tests/", 1)[-1], path.rsplit("/", 1)[-1]):
                candidate = candidate.lstrip("/")
                if candidate.startswith("tests/"):
                    candidate = candidate[len("tests/") :]
                if candidate in tests and candidate not in named:
                    named.append(candidate)
                    break
    if not named:
        named = sorted(path for path in tests if re.fullmatch(r"test_[^/]*\.py|[^/]*_test\.py", path))
    if not named:
        raise Refused("its tests/test.sh runs pytest, but tests/ has no test file it names or pytest would collect")
    return named


def _table(config: dict[str, Any], name: str) -> dict[str, Any]:
    table = config.get(name)
    return table if isinstance(table, dict) else {}


def read_task(
    folder: Path, *, base_images: dict[str, str], images: dict[str, str], internet_ok: bool = False
) -> tuple[dict[str, Any], Environment]:
    """One task folder as a task line, and how its image is had."""
    try:
        config = tomllib.loads((folder / "task.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise Refused(f"its task.toml cannot be read: {exc}") from None
    limits = read_limits(config, internet_ok=internet_ok)
    instruction_path = folder / "instruction.md"
    if not instruction_path.is_file():
        raise Refused("it has no instruction.md")
    instruction = instruction_path.read_text()
    if not instruction.strip():
        raise Refused("its instruction.md is empty")
    task_table = _table(config, "task")
    name = str(task_table.get("name") or folder.name)
    tests_dir = folder / "tests"
    if not (tests_dir / "test.sh").is_file():
        raise Refused("it has no tests/test.sh")
    tests: dict[str, str] = {}
    for path in sorted(p for p in tests_dir.rglob("*") if p.is_file()):
        relative = path.relative_to(tests_dir).as_posix()
        try:
            tests[relative] = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise Refused(f"its test file tests/{relative} is not UTF-8 text") from None
    test_files = pytest_files(tests["test.sh"], tests)
    environment_table = _table(config, "environment")
    preloaded = environment_table.get("docker_image")
    dockerfile = folder / "environment" / "Dockerfile"
    if preloaded:
        environment = Environment(image=images.get(str(preloaded), str(preloaded)))
        if dockerfile.is_file():  # its WORKDIR still says where the agent works
            workdirs = [
                line.split(None, 1)[1]
                for line in _logical_lines(dockerfile.read_text())
                if line.upper().startswith("WORKDIR ")
            ]
            environment.workdir = workdirs[-1] if workdirs and workdirs[-1].startswith("/") else DEFAULT_WORKDIR
    elif dockerfile.is_file():
        environment = translate_dockerfile(
            dockerfile.read_text(),
            environment_dir=folder / "environment",
            base_images=base_images,
            workdir_override=limits.workdir,
        )
        environment.image = image_name(name)
    else:
        raise Refused("it has neither environment/Dockerfile nor [environment] docker_image")
    environment.workdir = limits.workdir or environment.workdir
    if environment.workdir.rstrip("/") in ("", "/tests") or environment.workdir.startswith("/tests/"):
        raise Refused(f"its working directory {environment.workdir!r} would hold or be inside the tests folder")
    instance: dict[str, Any] = {
        "name": name,
        "instruction": instruction,
        "image": environment.image,
        "workdir": environment.workdir,
        "tests": tests,
        "test_files": test_files,
        **limits.instance_fields(),
        "source": str(folder),
    }
    return {"id": name, "handler": "terminal", "instance": instance}, environment


def import_folders(
    paths: Sequence[Path],
    *,
    base_images: dict[str, str] | None = None,
    images: dict[str, str] | None = None,
    internet_ok: bool = False,
) -> Imported:
    tasks: list[dict[str, Any]] = []
    refused: list[tuple[str, str]] = []
    environments: dict[str, Environment] = {}
    for folder in task_folders(paths):
        try:
            task, environment = read_task(
                folder, base_images=base_images or {}, images=images or {}, internet_ok=internet_ok
            )
            if task["id"] in environments:
                raise Refused("a second task with this name")
        except Refused as exc:
            refused.append((str(folder), str(exc)))
            continue
        tasks.append(task)
        environments[task["id"]] = environment
    missing = [path for path in paths if not path.is_dir()]
    refused += [(str(path), "not a folder") for path in missing]
    return Imported(tasks, refused, environments)


def write_context(environment: Environment, destination: Path) -> Path:
    """The build context of a translated environment: its folder's files and the Containerfile."""
    if environment.context is None:
        raise ValueError("a pre-loaded image has no build context")
    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(environment.context, destination)
    (destination / "Containerfile").write_text(environment.containerfile)
    return destination


def build(image: str, context: Path) -> None:
    subprocess.run(
        ["podman", "build", "--network", "none", "--pull-never", "-f", "Containerfile", "-t", image, str(context)],
        check=True,
    )


def _pairs(values: Sequence[str], flag: str) -> dict[str, str]:
    pairs = {}
    for value in values:
        old, sep, new = value.partition("=")
        if not sep or not old or not new:
            raise SystemExit(f"prorl import-harbor: {flag} takes NAME=IMAGE, not {value!r}")
        pairs[old] = new
    return pairs


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("import-harbor", help="turn Harbor / Terminal-Bench task folders into task lines")
    parser.add_argument("folders", type=Path, nargs="+", help="a task folder (with task.toml) or a folder of them")
    parser.add_argument("--out", type=Path, help="task lines to write (standard output without it)")
    parser.add_argument("--contexts", type=Path, help="write each translated environment's build context here")
    parser.add_argument("--build", action="store_true", help="build each translated environment with podman")
    parser.add_argument(
        "--base-image", action="append", default=[], metavar="NAME=LOCAL", help="map a FROM image to a local one"
    )
    parser.add_argument(
        "--image", action="append", default=[], metavar="NAME=LOCAL", help="rename a task's pre-loaded docker_image"
    )
    parser.add_argument(
        "--no-internet-ok",
        action="store_true",
        help="import tasks whose task.toml gives them network access, to run without it (the sandboxes have none)",
    )


def _write(tasks: Iterable[dict[str, Any]], out: TextIO) -> None:
    for task in tasks:
        out.write(json.dumps(task, ensure_ascii=False) + "\n")


def _refusals(refused: list[tuple[str, str]]) -> Iterator[str]:
    for name, reason in refused:
        yield f"refused {name}: {reason}"


def command(args: argparse.Namespace) -> int:
    result = import_folders(
        args.folders,
        base_images=_pairs(args.base_image, "--base-image"),
        images=_pairs(args.image, "--image"),
        internet_ok=args.no_internet_ok,
    )
    for task_id, environment in result.environments.items():
        if environment.context is None:
            continue
        if args.contexts or args.build:
            root = args.contexts or Path("harbor-contexts")
            context = write_context(environment, root / slug(task_id))
            print(f"{task_id}: build context {context} for {environment.image}", file=sys.stderr)
            if args.build:
                build(environment.image, context)
    if args.out:
        with args.out.open("w") as out:
            _write(result.tasks, out)
    else:
        _write(result.tasks, sys.stdout)
    for line in _refusals(result.refused):
        print(line, file=sys.stderr)
    where = args.out or "standard output"
    print(f"{len(result.tasks)} tasks written to {where}, {len(result.refused)} refused", file=sys.stderr)
    return 0 if result.tasks or not result.refused else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m prorl_client.harbor_import context TASK_DIR CONTEXT_DIR`: one shipped task's
    build context (scripts/build_images.sh); prints its image name."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != "context":
        print(main.__doc__, file=sys.stderr)
        return 2
    result = import_folders([Path(args[1])])
    if result.refused or not result.tasks:
        for line in _refusals(result.refused):
            print(line, file=sys.stderr)
        return 1
    environment = result.environments[result.tasks[0]["id"]]
    write_context(environment, Path(args[2]))
    print(environment.image)
    return 0


if __name__ == "__main__":
    sys.exit(main())
