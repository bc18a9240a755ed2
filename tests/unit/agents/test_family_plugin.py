"""A task family in its own package, as docs/handlers.md shows it: the worked example's module
with the doc's pyproject.toml's metadata is pip-installed (a wheel, into a folder of its own), the server finds
the family through the `prorl.families` entry point, and the doc's own test of it (on
`prorl_server.testing`'s fakes) passes. A broken plugin stops start-up, naming its entry point."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib
import re
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_server.agents.registry import PluginError, default_registry
from prorl_server.app import ProrlServer
from prorl_server.config import load_settings
from tests.unit.docs.handlers_md import HANDLERS_MD


def doc_blocks() -> tuple[str, str, str]:
    text = HANDLERS_MD.read_text()
    (module,) = re.findall(r"```python\n# prorl_server/agents/shell\.py\n(.*?)```", text, re.S)
    section = text[text.index("## A family in its own package") :]
    pyproject = re.search(r"```toml\n(.*?)```", section, re.S)
    test = re.search(r"```python\n(.*?)```", section, re.S)
    assert pyproject and test
    return module, pyproject.group(1), test.group(1)


def build_wheel(module: str, pyproject: str, into: Path) -> Path:
    """The package as a wheel, from the doc's pyproject.toml (name, version, entry points) and
    the worked example as its module: what `python -m build` makes of it, without needing the
    build tools here (no network)."""
    project = tomllib.loads(pyproject)["project"]
    name, version = project["name"], project["version"]
    dist = f"{name.replace('-', '_')}-{version}"
    entry_points = "".join(
        f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in points.items())
        for group, points in project["entry-points"].items()
    )
    files = {
        "prorl_shell/__init__.py": module,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}.dist-info/entry_points.txt": entry_points,
    }
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
        f"{len(text.encode())}\n"
        for path, text in files.items()
    )
    wheel = into / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
        archive.writestr(f"{dist}.dist-info/RECORD", record + f"{dist}.dist-info/RECORD,,\n")
    return wheel


def install(wheel: Path, target: Path) -> None:
    """pip install the wheel as a user would (into a folder of its own, not the shared venv)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--disable-pip-version-check", "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip


@pytest.fixture
def plugin_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    module, pyproject, _ = doc_blocks()
    target = tmp_path / "site"
    install(build_wheel(module, pyproject, tmp_path), target)
    assert (target / "prorl_shell" / "__init__.py").exists()
    monkeypatch.syspath_prepend(str(target))
    importlib.invalidate_caches()
    yield target
    sys.modules.pop("prorl_shell", None)


def test_the_installed_plugin_is_a_family_of_the_server(plugin_package: Path) -> None:
    registry = default_registry()
    assert "shell" in registry.names()
    assert type(registry.get("shell")).__module__ == "prorl_shell"
    assert "shell" not in default_registry(plugins=False).names()


async def test_the_docs_test_of_the_plugin_passes(plugin_package: Path) -> None:
    _, _, test_code = doc_blocks()
    namespace: dict[str, object] = {}
    exec(compile(test_code, str(HANDLERS_MD), "exec"), namespace)
    test = namespace["test_a_right_command_scores_1"]
    await asyncio.wait_for(test(), timeout=300)  # type: ignore[operator]


def test_a_plugin_that_does_not_load_stops_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "broken_family-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-family\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[prorl.families]\nbroken = no_such_module:Handler\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    settings = load_settings(None, environ={}, overrides={"jobs": {"store": False}})
    with pytest.raises(PluginError, match=r"entry point 'broken' = 'no_such_module:Handler' .* does not load"):
        ProrlServer(settings)


def test_a_plugin_may_not_take_a_shipped_familys_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "math_again-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: math-again\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[prorl.families]\nmath2 = prorl_server.agents.math:MathHandler\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    with pytest.raises(PluginError, match="names the family 'math', which this server already has"):
        default_registry()
