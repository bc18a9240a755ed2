"""Write examples/prorl.toml: every setting of prorl_server/config.py with its default and what it means.

The file is made from the settings models themselves (field, type, bounds, default and the
docstring under the field), so it cannot drift: tests/unit/docs/test_generated_docs.py fails when
it differs from what this script writes. Every setting is commented out, so the file as it
is gives the defaults; uncomment what you change.

Usage: python scripts/gen_example_config.py [--check]
"""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from generated import write_or_check  # scripts/generated.py
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from prorl_server.config import Settings

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "examples" / "prorl.toml"
HEADER = """\
# prorl-server settings: every one, with its default. Made by scripts/gen_example_config.py
# from prorl_server/config.py (do not edit by hand: a test checks it is current).
#
# Use: prorl-server serve --config prorl.toml. Every setting is commented out, so this file
# as it is gives the defaults: uncomment and change what you need. Each can also be set as
# PRORL_<SECTION>__<FIELD> in the environment or with --set SECTION.FIELD=VALUE (later wins:
# file, environment, flags). docs/operations.md explains them by task.
"""


def field_docs(model: type[BaseModel]) -> dict[str, str]:
    """The docstring under each field of `model` and its bases (PEP 257 attribute docstrings)."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def submodel(annotation: Any) -> type[BaseModel] | None:
    """The model of a section or a list of models (list[WarmPoolSettings])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is list:
        (inner,) = typing.get_args(annotation) or (None,)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return None


def type_text(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(arg) for arg in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(arg) for arg in typing.get_args(annotation))
    if origin is list:
        return f"list of {type_text(typing.get_args(annotation)[0])}"
    if origin is dict:
        key, value = typing.get_args(annotation)
        return f"table of {type_text(key)} -> {type_text(value)}"
    if annotation is type(None):
        return "unset"
    if annotation is SecretStr:
        return "secret string"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(annotation, str(annotation))


def bounds(info: FieldInfo) -> str:
    words = []
    for meta in info.metadata:
        for attr, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("pattern", "matching")):
            value = getattr(meta, attr, None)
            if value is not None:
                words.append(f"{symbol} {value}")
    return ", ".join(words)


def toml_value(value: Any) -> str:
    if isinstance(value, SecretStr):
        return json.dumps(value.get_secret_value())
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + " }"
    raise TypeError(f"no TOML form for {value!r}")


def comment(text: str, prefix: str = "# ") -> list[str]:
    lines = []
    for paragraph in text.splitlines():
        lines += textwrap.wrap(paragraph, 94, initial_indent=prefix, subsequent_indent=prefix) or [prefix.rstrip()]
    return lines


def section(model: type[BaseModel], name: str, *, table_array: bool = False) -> list[str]:
    """A [name] table (or a commented [[name]] example) of the model's settings, then its sub-tables."""
    lines = ["", f"# [[{name}]]" if table_array else f"[{name}]"]
    if model.__doc__ and model.__doc__ is not BaseModel.__doc__ and not model.__doc__.startswith("!!!"):
        lines += comment(inspect.cleandoc(model.__doc__))
    docs = field_docs(model)
    later: list[str] = []
    for field, info in model.model_fields.items():
        inner = submodel(info.annotation)
        if inner is not None and typing.get_origin(info.annotation) is not list:
            later += section(inner, f"{name}.{field}")
            continue
        lines.append("")
        if field in docs:
            lines += comment(docs[field])
        required = info.default is PydanticUndefined and info.default_factory is None
        default = None if required else info.get_default(call_default_factory=True)
        kind = type_text(info.annotation)
        limits = bounds(info)
        what = f"{kind}{', ' + limits if limits else ''}"
        shown = "required" if required else "default: " + ("unset" if default is None else toml_value(default))
        lines.append(f"# ({what}; {shown})")
        if inner is not None:  # a list of tables: one example entry, each of its fields explained
            lines.append(f"# {field} = []  # or one [[{name}.{field}]] table each, as below")
            later += section(inner, f"{name}.{field}", table_array=True)
        elif table_array:
            lines.append(f"## {field} = {toml_value(default) if default is not None else '...'}")
        elif default is None:
            lines.append(f"# {field} =")
        else:
            lines.append(f"# {field} = {toml_value(default)}")
    if table_array:
        lines = [line if line.startswith("#") or not line else "# " + line for line in lines]
    return lines + later


def render() -> str:
    lines = HEADER.splitlines()
    for name, info in Settings.model_fields.items():
        model = submodel(info.annotation)
        assert model is not None, name
        lines += section(model, name)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    return write_or_check(OUT, render(), argv, root=ROOT, script="gen_example_config.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
