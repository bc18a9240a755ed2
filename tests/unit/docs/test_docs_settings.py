"""Every setting is documented in docs/operations.md, with its default and allowed values.

The settings are found by walking `Settings`' field annotations (sections, nested
sections such as `llm.embedded`, and the entries of list settings such as
`llm.backends[]`), so a setting added anywhere, or a section moved to another
module, is covered without touching this test.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic_core import PydanticUndefined

from prorl_server.config import Settings

DOC = Path(__file__).resolve().parents[3] / "docs" / "operations.md"


@dataclass(frozen=True)
class Setting:
    name: str
    """Dotted, e.g. `llm.embedded.enabled`; entries of a list setting as `llm.backends[].id`."""
    default: Any
    annotation: Any


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The settings models an annotation holds: X, X | None, list[X]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (list, typing.Union, types.UnionType):
        return [model for arg in typing.get_args(annotation) for model in _models(arg)]
    return []


def settings(model: type[BaseModel] = Settings, prefix: str = "") -> list[Setting]:
    found: list[Setting] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        nested = _models(annotation)
        if typing.get_origin(annotation) is list and nested:  # a list of tables: the list, then its fields
            found.append(Setting(prefix + name, field.default, annotation))
            for entry in nested:
                found += settings(entry, f"{prefix}{name}[].")
        elif nested:  # a section
            for section in nested:
                found += settings(section, f"{prefix}{name}.")
        else:
            found.append(Setting(prefix + name, field.default, annotation))
    return found


def _rows() -> list[list[str]]:
    rows = []
    for line in DOC.read_text().splitlines():
        if line.startswith("|") and not line.startswith("| ---"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _row_of(setting: Setting, rows: list[list[str]]) -> list[str] | None:
    for row in rows:
        if f"`{setting.name}`" in row[0]:
            return row
    return None


def _shown(value: Any) -> list[str]:
    """How a default may be written in the default column (any one of these)."""
    if value is PydanticUndefined:
        return ["required"]
    if value is None:
        return ["none"]
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, bool):
        return [str(value).lower()]
    if isinstance(value, float) and value.is_integer():
        return [str(int(value)), str(value)]
    if isinstance(value, str):
        return [value] if value else ['""']
    if isinstance(value, (list, dict)) and not value:
        return ["[]" if isinstance(value, list) else "{}"]
    return [str(value)]


def _literal_values(annotation: Any) -> list[str]:
    if typing.get_origin(annotation) is typing.Literal:
        return [str(value) for value in typing.get_args(annotation)]
    return [value for arg in typing.get_args(annotation) for value in _literal_values(arg)]


def test_the_walk_finds_nested_and_list_settings() -> None:
    names = {setting.name for setting in settings()}
    assert {"server.port", "llm.embedded.enabled", "llm.backends", "llm.backends[].id"} <= names
    assert {"sandbox.warm_pools", "sandbox.warm_pools[].size"} <= names
    assert not {"llm", "llm.embedded", "server"} & names  # sections are not settings


def test_every_setting_is_documented() -> None:
    rows = _rows()
    missing = [setting.name for setting in settings() if _row_of(setting, rows) is None]
    assert not missing, f"settings missing from the tables of {DOC.name}: {', '.join(missing)}"


def test_documented_defaults_and_values_match_the_code() -> None:
    rows = _rows()
    wrong = []
    for setting in settings():
        row = _row_of(setting, rows)
        if row is None:
            continue  # reported by test_every_setting_is_documented
        default_cell, meaning = row[1], " ".join(row[1:])
        if isinstance(setting.default, list) and setting.default:
            absent = [item for item in setting.default if str(item) not in default_cell]
            if absent:
                wrong.append(f"{setting.name}: default column lacks {absent}")
        elif not any(shown in default_cell for shown in _shown(setting.default)):
            wrong.append(f"{setting.name}: default {setting.default!r} is not in the default column {default_cell!r}")
        unnamed = [
            value for value in _literal_values(setting.annotation) if not re.search(rf"\b{re.escape(value)}\b", meaning)
        ]
        if unnamed:
            wrong.append(f"{setting.name}: allowed values {unnamed} are not named in its row")
    assert not wrong, f"{DOC.name} disagrees with prorl_server/config.py:\n  " + "\n  ".join(wrong)
