"""Write docs/client-reference.md: the Python client's public API, from its docstrings.

Every name in `prorl_client.__all__` (the `Client` class with each public method's
signature and docstring, `connect`, `RpcError`), so the reference says what the code
does; tests/unit/docs/test_generated_docs.py fails when the file is not what this writes.

Usage: python scripts/gen_client_reference.py [--check]
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

from generated import write_or_check  # scripts/generated.py

import prorl_client

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "client-reference.md"


def doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else "(no docstring)"


def signature(name: str, obj: Any) -> str:
    text = str(inspect.signature(obj))
    return f"{name}{text}"


def members(cls: type) -> list[tuple[str, Any]]:
    found = []
    for name, value in cls.__dict__.items():
        if name.startswith("_") and name not in ("__aenter__", "__aexit__"):
            continue
        if isinstance(value, classmethod):
            value = value.__func__
        if inspect.isfunction(value):
            found.append((name, value))
    return found


def kind(func: Any) -> str:
    if inspect.isasyncgenfunction(func):
        return "async iterator"
    if inspect.iscoroutinefunction(func):
        return "coroutine"
    return "function"


def render() -> str:
    lines = [
        "# Python client reference",
        "",
        "Made by `scripts/gen_client_reference.py` from the docstrings of `prorl_client`",
        "(do not edit by hand: a test checks it is current). Messages are in `prorl_client.v1`,",
        "generated from `proto/prorl/v1` (docs/contract.md describes them).",
        "",
        "## `prorl_client`",
        "",
        doc(prorl_client),
    ]
    for name in prorl_client.__all__:
        obj = getattr(prorl_client, name)
        if name == "v1":
            continue
        if inspect.isclass(obj):
            lines += ["", f"## class `{name}`", "", doc(obj)]
            for method, func in members(obj):
                lines += ["", f"### `{name}.{method}` ({kind(func)})", "", "```python", signature(method, func), "```"]
                lines += ["", doc(func)]
            for prop, value in obj.__dict__.items():
                if isinstance(value, property) and not prop.startswith("_"):
                    lines += ["", f"### `{name}.{prop}` (property)", "", doc(value)]
        else:
            lines += ["", f"## `{name}`", "", "```python", signature(name, obj), "```", "", doc(obj)]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    return write_or_check(OUT, render(), argv, root=ROOT, script="gen_client_reference.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
