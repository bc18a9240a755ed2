"""A model's tokenizer and chat template from a local Hugging Face tokenizer folder.

The folder holds `tokenizer.json` (read with the `tokenizers` library) and
`tokenizer_config.json` (its `chat_template`, special tokens and whether a
BOS token is added). Nothing is fetched from a hub.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prorl_server.errors import InvalidArgument
from prorl_server.llm.chat_template import ChatTokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("content")) if value.get("content") is not None else None
    return str(value) if value is not None else None


class HFTokenizer(ChatTokenizer):
    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(folder)
        try:
            config = json.loads((path / "tokenizer_config.json").read_text())
            self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises its own Exception type
            raise InvalidArgument(
                f"cannot read a Hugging Face tokenizer from {path} (needs tokenizer.json and "
                f"tokenizer_config.json): {exc}"
            ) from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not template:
            raise InvalidArgument(f"{path}/tokenizer_config.json has no chat_template")
        bos = _token_text(config.get("bos_token"))
        eos = _token_text(config.get("eos_token"))
        super().__init__(template, special_tokens={"bos_token": bos or "", "eos_token": eos or ""})
        self._bos = [self._id(bos)] if config.get("add_bos_token") and bos else []
        stops = {eos, *(config.get("extra_stop_tokens") or [])}
        self._stop = frozenset(i for i in (self._tokenizer.token_to_id(t) for t in stops if t) if i is not None)

    def _id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise InvalidArgument(f"the tokenizer has no token {token!r}")
        return int(token_id)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    @property
    def bos_ids(self) -> list[int]:
        return list(self._bos)

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stop
