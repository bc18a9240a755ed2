"""Exact token trajectories across turns: no re-tokenisation drift.

Each turn's prompt is the previous prompt + the ids the model sampled + the
ids that close its reply and carry the new messages. The sampled ids are
never re-tokenised and history already sent is never rendered again, so the
trajectory's token_ids are exactly what the model saw and produced, and the
loss mask is 1 exactly on the sampled ids.

First prompt: the template's rendering of the conversation with the
generation prompt, exactly as transformers' `apply_chat_template` tokenizes
it (the template writes the BOS; a tokenizer that wants a BOS the template
does not write gets it once, in front).

Later prompts: many templates render a past reply differently once more
messages follow it (Qwen3 and DeepSeek-R1 drop thinking, Llama and Gemma
`trim`, Mistral moves the system prompt to the last user message, Phi
appends the EOS when no generation prompt follows), so the real
conversation is never re-rendered. The new messages are rendered after a
fixed base conversation instead: a short user message, then an assistant
message whose text (or whose tool calls' arguments, as a mapping or as JSON
text: templates differ) is a sentinel, with the same tool call names and ids
as the real reply (templates need those to render tool results). Every
render carries the job's tools (templates that declare them unconditionally
fail without).

What to append is read off the template's own structure, not off the first
end token after the sentinel (which, for a template that writes no end of
turn after a call, is the one closing the tool results):
- the reply's turn ends where a rendering of the base alone stops agreeing
  with the base followed by the new messages;
- in a call, the rest of the rendered call up to the turn's end token is the
  model's own text (it wrote its call itself) and is skipped;
- a block the template writes after the last message whatever it is
  (Command R's closing instruction turn) is already in the prompt and is not
  appended again;
- what remains (the close of the reply, the new messages, the generation
  prompt) is tokenized and appended, less one token if the model's sampled
  stop stands for it: the same token (GLM's `<|observation|>`, which opens
  the tool results), or the end-of-turn token that closes the reply (Llama's
  `<|eot_id|>` after a sampled `<|eom_id|>`). A role tag that is merely also a
  stop token is never dropped.
Since the base and the sentinel are rendered once per turn and discarded,
the BOS, default system prompts and tool declarations never repeat.

Where no base renders (a template that refuses every shape), the turn fails
as an infrastructure `LLMError` (reason `llm_template`) with the reason:
never silently.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prorl_server.errors import LLMError
from prorl_server.llm.base import ChatMessage
from prorl_server.llm.chat_template import ChatTokenizer


def new_sentinel() -> str:
    """Text no template changes (letters and digits: nothing to trim, no think tags, no specials)."""
    return "Zq" + secrets.token_hex(8) + "Qz"


CLOSERS = ("<|end|>",)
"""End-of-message tokens that are not stop tokens (gpt-oss ends a past message with `<|end|>`,
its generation with `<|return|>` or `<|call|>`). Used only when the tokenizer has them."""


@dataclass(frozen=True)
class ConversationMark:
    """A turn boundary of a TokenConversation (TokenConversation.mark)."""

    tokens: int
    turns: int
    messages: int
    sampled_stop: int | None


@dataclass(frozen=True)
class _Layout:
    reply_end: int
    """Where the reply's turn (its own end-of-turn token included) ends in the rendering."""
    trailing: str
    """What the template writes after the last message whatever it is (not a message; "" mostly)."""
    generation: str
    """The generation prompt at the rendering's end."""
    exact: bool
    """False: `reply_end` is only bounded (by an end token or the first new message's text)."""


class TokenConversation:
    def __init__(
        self,
        tokenizer: ChatTokenizer,
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._tools = list(tools) if tools else None
        self._kwargs = dict(template_kwargs or {})
        self._messages: list[ChatMessage] = []
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turn_spans: list[tuple[int, int]] = []
        """(start, end) of each turn's sampled ids in token_ids."""
        self._awaiting_reply = False
        self._sampled_stop: int | None = None
        """The stop id the last reply ended with (None: it ended without one, e.g. at max_tokens)."""
        self._ends = _end_markers(tokenizer)
        self._end_ids = {ids[0] for ids in map(tokenizer.encode, self._ends) if len(ids) == 1}

    def prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The ids to send for `messages` (the whole conversation so far)."""
        known = len(self._messages)
        if [_key(m) for m in messages[:known]] != [_key(m) for m in self._messages] or len(messages) < known:
            raise LLMError(
                "the conversation was rewritten between turns; token trajectories only grow", reason="llm_prompt"
            )
        if self._awaiting_reply:  # the same request again (after a pause aborted it)
            if len(messages) != known:
                raise LLMError("a new prompt before the reply to the last one", reason="llm_prompt")
            return list(self.token_ids)
        if not self._messages:
            ids = self._first_prompt(messages)
        else:
            ids = self._continuation(messages[known - 1], messages[known:])
        self._append(ids, sampled=False)
        self._messages = [m.copy() for m in messages]
        self._awaiting_reply = True
        return list(self.token_ids)

    def record(self, assistant: ChatMessage, sampled_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Add the model's reply: its sampled ids (mask 1) and log-probs, exactly as sampled."""
        start = len(self.token_ids)
        self._append(list(sampled_ids), sampled=True, logprobs=logprobs)
        self.turn_spans.append((start, len(self.token_ids)))
        self._messages.append(assistant)
        self._sampled_stop = sampled_ids[-1] if sampled_ids and sampled_ids[-1] in self._tokenizer.stop_ids else None
        self._awaiting_reply = False

    def mark(self) -> ConversationMark:
        """Where the conversation is now: a point a branch can start from (the lists only grow)."""
        if self._awaiting_reply:
            raise LLMError("no branch point while a reply is awaited", reason="llm_prompt")
        return ConversationMark(len(self.token_ids), len(self.turn_spans), len(self._messages), self._sampled_stop)

    def branch(self, mark: ConversationMark, *, train_prefix: bool) -> TokenConversation:
        """A new conversation holding exactly this one's ids, log-probs and turns up to `mark`; its
        loss mask is 0 on that prefix unless `train_prefix` (the branch's own turns get 1)."""
        other = TokenConversation.__new__(TokenConversation)
        other.__dict__.update(self.__dict__)
        other._messages = [m.copy() for m in self._messages[: mark.messages]]
        other.token_ids = self.token_ids[: mark.tokens]
        other.loss_mask = self.loss_mask[: mark.tokens] if train_prefix else [0] * mark.tokens
        other.logprobs = self.logprobs[: mark.tokens]
        other.turn_spans = self.turn_spans[: mark.turns]
        other._awaiting_reply = False
        other._sampled_stop = mark.sampled_stop
        return other

    def _render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """Always with the job's tools: templates that declare them unconditionally need them on every render."""
        return self._tokenizer.render(
            messages, add_generation_prompt=add_generation_prompt, tools=self._tools, template_kwargs=self._kwargs
        )

    def _first_prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        text = self._render(messages)
        ids = self._tokenizer.encode(text)
        bos_text = self._tokenizer.bos_text
        if self._tokenizer.bos_ids and not (bos_text and text.startswith(bos_text)):
            ids = self._tokenizer.bos_ids + ids
        return ids

    def _continuation(self, assistant: ChatMessage, new: Sequence[ChatMessage]) -> list[int]:
        """Ids that close the last reply, then the new messages, then the generation prompt."""
        problems: list[str] = []
        sentinel = new_sentinel()
        while sentinel in json.dumps(list(new), ensure_ascii=False):  # never found in a new message
            sentinel = new_sentinel()
        for base, in_call in _bases(assistant, sentinel):
            try:
                text = self._render([*base, *new], add_generation_prompt=True)
            except LLMError as exc:
                problems.append(str(exc))
                continue
            index = text.rfind(sentinel)
            if index < 0:
                problems.append("the template dropped the reply")
                continue
            after = index + len(sentinel)
            layout = self._layout(base, new, text, after)
            written = after  # what the model wrote itself ends here; the template's text follows
            if in_call:  # the rest of the rendered call is the model's own text, up to the turn's end token
                hit = _first_end(text[after : layout.reply_end], self._ends)
                if hit is None and layout.exact:
                    written = layout.reply_end  # the template closes a call with nothing
                elif hit is None:
                    problems.append("no end-of-turn token after a tool call")
                    continue
                else:
                    written = after + hit[0]
            closing = text[written : layout.reply_end]
            following = text[layout.reply_end : len(text) - len(layout.generation)]
            if layout.trailing and following.endswith(layout.trailing):
                following = following[: -len(layout.trailing)]  # already in the prompt, after the last message
            return self._less_stand_in(closing, self._tokenizer.encode(closing + following + layout.generation))
        raise LLMError(
            "cannot build the next prompt with this chat template: " + "; ".join(dict.fromkeys(problems)),
            reason="llm_template",
        )

    def _less_stand_in(self, closing: str, ids: list[int]) -> list[int]:
        """`ids` less the template token that the model's sampled stop token already stands for.

        The sampled stop stands in for the very token the template writes next (GLM's
        `<|observation|>`, which opens the tool results), or for the end-of-turn token that
        closes the reply (Llama's `<|eom_id|>` for its `<|eot_id|>`: one end of turn, not two).
        Never for anything else: a role tag that merely is a stop token stays.
        """
        stop = self._sampled_stop
        if stop is None or not ids:
            return ids
        if ids[0] == stop or (closing.startswith(tuple(self._ends)) and ids[0] in self._end_ids):
            return ids[1:]
        return ids

    def _layout(self, base: list[dict[str, Any]], new: Sequence[ChatMessage], text: str, after: int) -> _Layout:
        """Where, in `text` (base + new rendered), the reply's turn ends, and what is not a message.

        The reply's turn ends where a rendering of the base alone (no generation prompt) stops
        agreeing with `text`: both render the reply, only `text` goes on with the new messages. A
        template that writes something after the last message (Command R's closing instruction
        turn) writes it in both; it is found as their common tail and is `trailing`: it is already
        in the prompt and never repeated. Where the structure is not that clear (a template that
        renders its last message differently), the turn's end is bounded by the first new message's
        text, so nothing of a new message is ever skipped.
        """
        generation = ""
        try:
            whole = self._render([*base, *new], add_generation_prompt=False)
            if text.startswith(whole):
                generation = text[len(whole) :]
            alone = self._render(base, add_generation_prompt=False)
        except LLMError:
            return _Layout(self._bound(text, after, new), "", generation, exact=False)
        if text.startswith(alone):
            return _Layout(len(alone), "", generation, exact=True)
        common = _common_prefix(text, alone)
        shared = min(_common_suffix(alone, whole), len(alone) - after)
        low, high = len(alone) - shared, common
        if common < after or low > high or (not generation and whole != text):
            return _Layout(self._bound(text, after, new), "", generation, exact=False)
        # Between `low` and `high` the text is both a possible end of the reply and a possible start
        # of what follows it: the reply's turn ends after its own end token if it writes one there.
        hit = _first_end(text[low:high], self._ends)
        end = low + hit[0] + len(hit[1]) if hit else low
        return _Layout(end, alone[end:], generation, exact=True)

    def _bound(self, text: str, after: int, new: Sequence[ChatMessage]) -> int:
        """The reply ends before the first new message's own text (or at its first end token)."""
        bound = len(text)
        for message in new:
            content = message.get("content")
            if isinstance(content, str) and content.strip():
                found = text.find(content.strip(), after)
                if found >= 0:
                    bound = found
                break
        hit = _first_end(text[after:bound], self._ends)
        return after + hit[0] + len(hit[1]) if hit else bound

    def _append(self, ids: list[int], *, sampled: bool, logprobs: Sequence[float] = ()) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if sampled else 0] * len(ids))
        self.logprobs.extend(list(logprobs) if sampled else [0.0] * len(ids))


def _bases(assistant: Mapping[str, Any], sentinel: str) -> list[tuple[list[dict[str, Any]], bool]]:
    """Base conversations to render new messages after, most faithful first; True: sentinel in a tool call."""
    user: dict[str, Any] = {"role": "user", "content": "Hello."}
    system: dict[str, Any] = {"role": "system", "content": "You are a helpful assistant."}
    plain: dict[str, Any] = {"role": "assistant", "content": sentinel}
    shapes: list[tuple[dict[str, Any], bool]] = []
    # Arguments as a mapping (most templates) or as the JSON text (templates that join strings).
    for arguments in ({"s": sentinel}, json.dumps({"s": sentinel})):
        calls = [
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": str((call.get("function") or {}).get("name") or ""), "arguments": arguments},
            }
            for call in assistant.get("tool_calls") or []
        ]
        if calls:
            shapes += [
                ({"role": "assistant", "content": None, "tool_calls": calls}, True),
                ({"role": "assistant", "content": "", "tool_calls": calls}, True),
            ]
    shapes.append((plain, False))
    return [([*prefix, reply], in_call) for prefix in ([user], [system, user]) for reply, in_call in shapes]


def _end_markers(tokenizer: ChatTokenizer) -> list[str]:
    markers = {tokenizer.decode([i]) for i in tokenizer.stop_ids}
    for closer in CLOSERS:
        ids = tokenizer.encode(closer)
        if len(ids) == 1:
            markers.add(closer)
    return sorted((m for m in markers if m), key=len, reverse=True)


def _first_end(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    found = [(text.find(marker), marker) for marker in markers]
    hits = [(pos, marker) for pos, marker in found if pos >= 0]
    if not hits:
        return None
    return min(hits, key=lambda hit: (hit[0], -len(hit[1])))


def _common_prefix(a: str, b: str) -> int:
    """Characters `a` and `b` share at their start."""
    return len(os.path.commonprefix([a, b]))  # noqa: RUF071 (strings, not paths)


def _common_suffix(a: str, b: str) -> int:
    """Characters `a` and `b` share at their end."""
    return len(os.path.commonprefix([a[::-1], b[::-1]]))  # noqa: RUF071 (strings, not paths)


def _key(message: Mapping[str, Any]) -> tuple[str, str]:
    return str(message.get("role")), str(message.get("content") or "")
