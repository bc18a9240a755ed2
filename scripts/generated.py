"""Writes a file made from the code, or with `--check` fails when the committed one differs.

Shared by the scripts that generate docs/client-reference.md and examples/prorl.toml.
"""

from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(out: Path, text: str, argv: list[str], *, root: Path, script: str) -> int:
    """0 when `out` was written (or, with `--check`, is current); 1 when it is stale."""
    if "--check" in argv:
        if not out.exists() or out.read_text() != text:
            print(f"{out.relative_to(root)} is stale: run python scripts/{script}", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out.relative_to(root)}", file=sys.stderr)
    return 0
