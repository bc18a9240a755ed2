"""Capping tool output so one noisy command cannot flood a trajectory."""

from __future__ import annotations


def cap_output(data: bytes, limit: int) -> tuple[str, bool]:
    """Decode `data`, keeping its head and tail when it exceeds `limit` bytes.

    The cut is marked in the text, so the agent knows output is missing.
    """
    if len(data) <= limit:
        return data.decode(errors="replace"), False
    head = data[: limit // 2].decode(errors="ignore")
    tail = data[-(limit // 2) :].decode(errors="ignore")
    omitted = len(data) - 2 * (limit // 2)
    return f"{head}\n[... {omitted} bytes of output truncated ...]\n{tail}", True


def cap_text(text: str, limit: int) -> tuple[str, bool]:
    """`cap_output` for text: keeps about `limit` bytes of its UTF-8 encoding, head and tail
    (lone surrogates, which protobuf refuses, become "?")."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return data.decode("utf-8"), False
    return cap_output(data, limit)
