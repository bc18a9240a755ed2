"""The worked examples of docs/handlers.md, loaded as the modules they say they are."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

HANDLERS_MD = Path(__file__).resolve().parents[3] / "docs" / "handlers.md"


def example_module(path: str, name: str) -> types.ModuleType:
    """The one python block of handlers.md that starts with the comment `# <path>`, run as
    module `name`."""
    pattern = rf"```python\n(# {re.escape(path)}\n.*?)```"
    (code,) = re.findall(pattern, HANDLERS_MD.read_text(), re.S)
    module = types.ModuleType(name)
    sys.modules[module.__name__] = module  # pydantic resolves the models' annotations through it
    try:
        exec(compile(code, str(HANDLERS_MD), "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module
