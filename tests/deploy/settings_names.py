"""Which PRORL_<SECTION>__<FIELD> variable names are settings, found by walking `Settings`.

The deploy files set settings through the environment. A misspelt variable with a double
underscore is refused at start (an unknown setting); one with a single underscore where a
double was meant (PRORL_SERVER_PORT) is not a setting name at all and is silently ignored,
so the tests look at every name.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from pydantic import BaseModel

from prorl_server.config import ENV_PREFIX, Settings

SETTING_VARIABLE = re.compile(r"\bPRORL_[A-Z0-9_]*__[A-Z0-9_]+\b")
"""A settings variable as written in a script or manifest: PRORL_SERVER__PORT."""
OWN_VARIABLE = re.compile(r"\bPRORL_[A-Z0-9]+(?:_[A-Z0-9]+)*\b(?!__)")
"""A PRORL_ name without a double underscore: never a setting (PRORL_POSTGRES_PORT)."""


def _section(annotation: Any) -> type[BaseModel] | None:
    """The settings model a field holds as a section (X or X | None), else None.
    A list of models (llm.backends) is one setting, set whole."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [arg for arg in typing.get_args(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def setting_of(variable: str) -> str | None:
    """`server.port` for PRORL_SERVER__PORT; None when no setting has that name."""
    if not variable.startswith(ENV_PREFIX) or "__" not in variable:
        return None
    path = [part.lower() for part in variable[len(ENV_PREFIX) :].split("__")]
    model: type[BaseModel] | None = Settings
    for depth, part in enumerate(path):
        if model is None or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        model = _section(field.annotation)
        if depth < len(path) - 1 and model is None:
            return None
    if model is not None:  # a whole section is not one setting
        return None
    return ".".join(path)
