"""A model's tokenizer and chat template from a local Hugging Face tokenizer folder.

The folder holds `tokenizer.json` (read with the `tokenizers` library) and
`tokenizer_config.json` (its `chat_template`, special tokens; a list of named
templates gives "default", and "tool_use" for renders with tools, as
transformers chooses: Command R and Hermes 2 Pro ship theirs so); a
`chat_template.jinja` file, when present, is the template (newer model
folders keep it there). `generation_config.json`, when present, adds its
`eos_token_id` (one id or a list: Llama 3.1 ends a turn on `<|eot_id|>`,
`<|eom_id|>` and `<|end_of_text|>`) to the stop ids. Nothing is fetched from
a hub.

As in transformers, the chat template alone writes the BOS: a rendered chat
is tokenized without adding special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prorl_server.errors import InvalidArgument, LLMError
from prorl_server.llm.chat_template import ChatTokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("content")) if value.get("content") is not None else None
    return str(value) if value is not None else None


_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}


def _int_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class HFTokenizer(ChatTokenizer):
    def __init__(self, folder: str | Path, *, template_kwargs: dict[str, Any] | None = None) -> None:
        from tokenizers import Tokenizer

        path = Path(folder)
        try:
            config = json.loads((path / "tokenizer_config.json").read_text())
            generation = _read_json(path / "generation_config.json")
            self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises its own Exception type
            raise InvalidArgument(
                f"cannot read a Hugging Face tokenizer from {path} (needs tokenizer.json and "
                f"tokenizer_config.json): {exc}"
            ) from None
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        tool_template = None
        if isinstance(template, list):  # named templates: "default", and "tool_use" when tools are given
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template, tool_template = named.get("default"), named.get("tool_use")
        if not template:
            raise InvalidArgument(f"{path}/tokenizer_config.json has no chat_template")
        special = {name: _token_text(config.get(name)) or "" for name in _SPECIAL_NAMES}
        try:
            super().__init__(
                template, special_tokens=special, template_kwargs=template_kwargs, tool_template=tool_template
            )
        except LLMError as exc:
            raise InvalidArgument(f"{path}: {exc}") from None
        stops = {special["eos_token"], *(config.get("extra_stop_tokens") or [])}
        ids = {self._tokenizer.token_to_id(t) for t in stops if t}
        ids.update(_int_list(generation.get("eos_token_id")))
        self._stop = frozenset(i for i in ids if i is not None)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    @property
    def bos_ids(self) -> list[int]:
        return []

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stop
