"""The trainer's sampling over an agent program's: what a gateway call may change.

A program on the model gateway writes its own sampling fields, but the job's
sampling (the trainer's `SamplingParams`) is what the policy is trained
under, so it is both the default and the ceiling of every call:

- `max_tokens`: the program's when it asks for fewer, never more than the job's;
- `stop`: the job's stop strings always, then the program's own, as Submit
  bounds them (at most 16 in all, each 1-256 characters): the rest are dropped;
- `temperature`, `top_p`, `seed`: the job's, unless the job lets its program
  choose them (the command family's `program.sampling: "program"`);
- `chat_template_kwargs`: the job's only (with the backend's own): a program
  never chooses how its prompt is rendered;
- `model`: the job's (the program's `model` field is only echoed back).

`clamp` returns the call's effective sampling and what it changed, as a small
dict (field -> [asked, used]) that the job's chains keep per call (chains.py);
`as_rows` writes it as the call's model-turn event carries it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from prorl_server.llm.base import Sampling

MAX_STOP_STRINGS = 16
"""As Submit bounds a job's stop strings (jobs/validation.py)."""
MAX_STOP_CHARS = 256


def _stops(job: tuple[str, ...], asked: tuple[str, ...]) -> tuple[str, ...]:
    kept = list(dict.fromkeys(job))
    for stop in asked:
        if len(kept) >= MAX_STOP_STRINGS:
            break
        if 0 < len(stop) <= MAX_STOP_CHARS and stop not in kept:
            kept.append(stop)
    return tuple(kept)


def clamp(asked: Sampling, job: Sampling, *, program_sampling: bool = False) -> tuple[Sampling, dict[str, Any]]:
    """The sampling a call gets for what it `asked` (the job's with the request's fields over it),
    and the fields that differ from what it asked: {field: [asked, used]}."""
    used = replace(
        job,
        max_tokens=min(asked.max_tokens, job.max_tokens),
        stop=_stops(job.stop, asked.stop),
        chat_template_kwargs=dict(job.chat_template_kwargs),
    )
    if program_sampling:
        used = replace(used, temperature=asked.temperature, top_p=asked.top_p, seed=asked.seed)
    changed: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        before, after = getattr(asked, name), getattr(used, name)
        if before != after:
            changed[name] = [before, after]
    dropped = [stop for stop in asked.stop if stop not in used.stop]
    if dropped:
        changed["stop"] = {"asked": len(asked.stop), "dropped": len(dropped), "kept": len(used.stop)}
    if asked.chat_template_kwargs != used.chat_template_kwargs:
        keys = sorted(
            k
            for k in asked.chat_template_kwargs
            if asked.chat_template_kwargs[k] != job.chat_template_kwargs.get(k, object())
        )
        changed["chat_template_kwargs"] = {"dropped": keys[:16]}
    return used, changed


def _shown(value: Any) -> str:
    return "" if value is None else json.dumps(value)


def as_rows(changed: dict[str, Any]) -> tuple[tuple[str, str, str], ...]:
    """`clamp`'s changes as (field, asked, used) strings, for reading (the ModelTurn event)."""
    rows = []
    for name, change in changed.items():
        if name == "stop":
            rows.append((name, f"{change['asked']} strings", f"{change['kept']} strings"))
        elif name == "chat_template_kwargs":
            rows.append((name, ", ".join(change["dropped"]), "the job's"))
        else:
            rows.append((name, _shown(change[0]), _shown(change[1])))
    return tuple(rows)
