"""Files made from the code stay what the code makes: examples/prorl.toml (every server setting)
and docs/client-reference.md (the client's API from its docstrings)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from prorl_server.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "prorl.toml"


def check(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--check"], capture_output=True, text=True, check=False
    )


def test_the_example_config_is_current() -> None:
    result = check("gen_example_config.py")
    assert result.returncode == 0, result.stderr


def test_the_client_reference_is_current() -> None:
    result = check("gen_client_reference.py")
    assert result.returncode == 0, result.stderr


def uncommented(text: str) -> str:
    """The example with every `# name = value` setting uncommented (`## ...` lines stay examples)."""
    return "\n".join(re.sub(r"^# ([a-z_]+ = .+)$", r"\1", line) for line in text.splitlines())


def test_the_example_config_names_every_setting_with_its_default(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    assert load_settings(EXAMPLE, environ={}) == Settings()  # as shipped: all defaults
    full = tmp_path / "full.toml"
    full.write_text(uncommented(text))
    assert load_settings(full, environ={}) == Settings()  # each value shown is the default
    data = tomllib.loads(full.read_text())

    def names(model: type, prefix: str) -> list[str]:
        found = []
        for name, info in model.model_fields.items():  # type: ignore[attr-defined]
            annotation = info.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                found += names(annotation, f"{prefix}{name}.")
            else:
                found.append(f"{prefix}{name}")
        return found

    for dotted in names(Settings, ""):
        *sections, field = dotted.split(".")
        table = data
        for part in sections:
            table = table[part]
        line = f"# {field} ="
        assert field in table or line in text, f"{dotted} is missing from {EXAMPLE.name}"
    # every setting has a comment saying its type and default, right above it
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if re.match(r"^# [a-z_]+ =", line):
            assert lines[index - 1].startswith("# ("), f"no type and default above {line!r}"
