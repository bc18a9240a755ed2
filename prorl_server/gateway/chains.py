"""An agent program's model calls, as exact token chains.

A program on the model gateway sends its whole conversation with every call.
Consecutive calls whose messages extend the previous call's (with its reply)
continue one chain: one TokenConversation, so the chain's token_ids are
exactly what the model saw and sampled, with no re-tokenisation. A call that
extends no chain (the program compacted its context, started a sub-agent,
retried with fewer messages, or runs calls side by side) starts a new chain.

Matching is on what the program sends back. Its copy of our reply is the
gateway's rendering of it (tool calls parsed out of the text, ids added), not
the text the model sampled; it matches when its tool calls (names and
arguments) are the reply's and its text is part of the sampled text (the
gateway only removes tool-call markup). On a token chain the chain then sends the
sampled text in its place: the token conversation keeps the reply's sampled ids
and never renders it again. Anything else (an edited reply, a changed message,
other tools) is a rewritten history: a new chain.

A conversation that is rendered whole (a new chain's first prompt, every call to
a chat backend) must show each earlier reply's tool calls once: as the template
writes the structured calls, after the reply's text without their markup (the
text the gateway gave). The history reaches the chains with the sampled text put
back (gateway/common.py), markup and structured calls both; such a reply's text
is replaced by the gateway's for the render (`_Shown`).

Memory: a chain keeps no copy of the program's messages, only a digest of
each (what makes it the same message for the chain) and the replies the model
sampled; a call that continues the chain sends the program's own copy of each
matched message. So a job's memory grows with what the model wrote, not with
the conversations its program sends (100 distinct 5 MB conversations used to
keep 500 MB for the job's life).

Sampling: each call's is the job's over what the program asked (sampling.py);
what was changed is kept per call (`clamped`, reported in the result's
details). Blame: a backend's refusal of the program's request (reasons in
`PROGRAM_CAUSED`) is the program's, never an `outage`.

The last call's conversation, kept for the result's `trajectory.messages`, is
cut to a budget (`max_result_message_bytes`) so that a result stays readable by
clients on gRPC's default 4 MiB limit; what was cut is counted in `report()`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prorl_server.errors import LLMError
from prorl_server.gateway.common import read_reply
from prorl_server.gateway.sampling import as_rows, clamp
from prorl_server.llm.base import ChatMessage, ChatResult, Sampling
from prorl_server.llm.job_chat import JobChat
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession

Message = ChatMessage
"""A message of a program's conversation (the alias reads as what the chains compare)."""

PROGRAM_CAUSED = frozenset({"llm_bad_request", "llm_prompt"})
"""LLMError reasons that the program's request caused (the backend refused it with a 4xx; a history
a token trajectory cannot take): the call's error is the program's, not an outage."""
DEFAULT_RESULT_MESSAGE_BYTES = 1 << 20
MAX_CLAMP_NOTES = 64
"""Calls whose clamped sampling is listed one by one in `report()` (all are counted)."""


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
    return raw


def _call_keys(calls: Any) -> list[tuple[str, Any]]:
    """(name, arguments) of OpenAI-form tool calls."""
    keys = []
    for call in calls or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        keys.append((str(function.get("name", "")), _arguments(function.get("arguments"))))
    return keys


def _key(message: Message) -> tuple[Any, ...]:
    """What makes two messages the same for the chain (representation aside)."""
    return (
        str(message.get("role", "")),
        _text(message.get("content")).strip(),
        json.dumps(_call_keys(message.get("tool_calls")), sort_keys=True, default=str),
        str(message.get("tool_call_id") or ""),
        str(message.get("name") or "") if message.get("role") == "tool" else "",
    )


def _digest(message: Message) -> bytes:
    """The message as the chain recognises it (`_key`), in 16 bytes."""
    key = json.dumps(_key(message), ensure_ascii=False, default=str).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(key, digest_size=16).digest()


@dataclass
class _Reply:
    """A reply the model sampled, as the chain must send it again and recognise it."""

    text: str
    calls: list[tuple[str, Any]]
    """(name, arguments) of the tool calls the gateway gave for it."""
    shown: str = ""
    """The text the gateway gave for it: `text` without the calls' markup."""
    exact: bool = True
    """From a token backend: its sampled ids are in the chain and never rendered again."""

    def matches(self, echoed: Message) -> bool:
        if echoed.get("role") != "assistant":
            return False
        if self.calls != _call_keys(echoed.get("tool_calls")):
            return False
        return _text(echoed.get("content")).strip() in self.text

    def as_sent(self, echoed: Message) -> Message:
        """The sampled text (the gateway's, if the reply is rendered again: see the module
        docstring), with the program's tool calls (their ids are what its tool results name)."""
        message: Message = {"role": "assistant", "content": self.text if self.exact else self.shown}
        if echoed.get("tool_calls"):
            message["tool_calls"] = echoed["tool_calls"]
        return message


@dataclass
class Chain:
    session: LLMSession
    tools_key: str
    history: list[bytes | _Reply] = field(default_factory=list)
    """The program's messages so far (their digests), with the model's replies in their place."""
    awaiting: bool = False
    """The last call got no reply (it failed, or was cancelled): only the same call again (a
    resend) may continue the chain."""
    in_flight: bool = False
    """A call is under way: no other call joins the chain meanwhile (not even an identical one:
    calls side by side are separate samples)."""
    calls: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Per token: the policy version of the call that added it."""

    def continuation(
        self, messages: Sequence[Message], digests: Sequence[bytes], shown: _Shown
    ) -> list[Message] | None:
        """The messages to send on this chain for `messages` (`digests`: theirs), or None if they
        do not extend it."""
        known = len(self.history)
        if self.in_flight or len(messages) < known or (self.awaiting and len(messages) != known):
            return None
        sent: list[Message] = []
        for mine, theirs, digest in zip(self.history, messages, digests, strict=False):
            if isinstance(mine, _Reply):
                if not mine.matches(theirs):
                    return None
                sent.append(mine.as_sent(theirs))
            elif mine != digest:
                return None
            else:
                sent.append(shown.rendered(theirs))
        return sent + [shown.rendered(m) for m in messages[known:]]


class _Shown:
    """The job's replies whose calls the gateway read out of their text: the sampled text -> the
    text without the calls' markup. Keeps references to the chains' own strings, not copies."""

    def __init__(self) -> None:
        self._by_sampled: dict[str, str] = {}

    def add(self, reply: _Reply) -> None:
        if reply.calls and reply.shown != reply.text:
            self._by_sampled[reply.text] = reply.shown

    def rendered(self, message: Message) -> Message:
        """`message` as a whole-conversation render must see it: a reply of this job's, with its
        sampled text and its structured calls both, gets the gateway's text."""
        content = message.get("content")
        if message.get("role") == "assistant" and message.get("tool_calls") and isinstance(content, str):
            shown = self._by_sampled.get(content)
            if shown is not None:
                return {**message, "content": shown}
        return message.copy()


class CallChains:
    """The chains of one job's gateway calls; `chat` is what the gateway calls."""

    def __init__(
        self,
        job_id: str,
        router: BackendRouter,
        *,
        on_call: Callable[[int, ChatResult], None] | None = None,
        min_policy_version: int = 0,
        job_sampling: Sampling | None = None,
        program_sampling: bool = False,
        max_result_message_bytes: int = DEFAULT_RESULT_MESSAGE_BYTES,
    ) -> None:
        """`on_call(number, result)` is told of every call that got its reply (the recorder).
        `job_sampling`: the ceiling and default of every call's sampling (None: as asked), the
        program choosing temperature, top_p and seed only with `program_sampling`."""
        self._job_sampling = job_sampling
        self._program_sampling = program_sampling
        self._message_budget = max_result_message_bytes
        self.clamped: list[dict[str, Any]] = []
        """The first calls whose sampling was changed: {"call": n, field: [asked, used], ...}."""
        self.clamped_calls = 0
        self.messages_cut: dict[str, int] = {}
        """What the result's messages lost to the budget: messages dropped, characters cut."""
        self.tools_left_out: dict[str, int] = {}
        """Per tool type the gateway cannot run (hosted web search, ...): the calls that offered it,
        left out of what the model saw."""
        self._job_id = job_id
        self._min_policy_version = min_policy_version
        self._router = router
        self.on_call = on_call
        self.chains: list[Chain] = []
        self.calls = 0
        self.last_conversation: list[Message] = []
        """The latest call's messages and its reply, as the program sent them and the model wrote it."""
        self.last_chain: Chain | None = None
        self._shown = _Shown()
        self.outage: LLMError | None = None
        """The backends' failure on the latest call, when no call succeeded since: the program could
        not reach the model (the job fails as infrastructure, not as the policy's doing)."""

    def _chain_for(
        self, messages: Sequence[Message], digests: Sequence[bytes], tools_key: str
    ) -> tuple[Chain, list[Message]]:
        for chain in reversed(self.chains):
            if chain.tools_key != tools_key:
                continue
            sent = chain.continuation(messages, digests, self._shown)
            if sent is not None:
                return chain, sent
        session = LLMSession(
            self._job_id, self._router, job_chat=JobChat(native_tools=True), min_policy_version=self._min_policy_version
        )
        chain = Chain(session, tools_key)
        self.chains.append(chain)
        return chain, [self._shown.rendered(m) for m in messages]

    async def chat(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        """One model call of the program, on the chain it extends (or a new one)."""
        tools_key = json.dumps(list(tools), sort_keys=True, default=str)
        digests = [_digest(m) for m in messages]
        # No await before `in_flight` is set: calls made side by side go to separate chains.
        chain, sent = self._chain_for(messages, digests, tools_key)
        turn = self.calls
        self.calls += 1
        changed: dict[str, Any] = {}
        if self._job_sampling is not None:
            sampling, changed = clamp(sampling, self._job_sampling, program_sampling=self._program_sampling)
            if changed:
                self.clamped_calls += 1
                if len(self.clamped) < MAX_CLAMP_NOTES:
                    self.clamped.append({"call": turn, **changed})
        chain.awaiting = chain.in_flight = True
        chain.history += digests[len(chain.history) :]
        try:
            result = await chain.session.chat(sent, tools, sampling)
        except LLMError as exc:  # a full context is the policy's, not an LLMError
            # The backend refused the program's own request: the program reached the model.
            self.outage = None if exc.reason in PROGRAM_CAUSED else exc
            raise
        finally:
            chain.in_flight = False
            del sent
        self.outage = None
        chain.awaiting = False
        if changed:
            result = dataclasses.replace(result, sampling_changes=as_rows(changed))
        # Every token not yet versioned is this call's: its prompt (also one a failed attempt sent)
        # and its sample.
        chain.versions += [result.policy_version] * (len(chain.session.token_trajectory()[0]) - len(chain.versions))
        chain.calls.append(turn)
        self.last_chain = chain
        reply = read_reply(result, parse_calls=bool(tools), id_prefix=f"c{turn}")  # as the gateway answers
        sampled = _Reply(
            result.text,
            [(call.name, call.arguments) for call in reply.calls],
            shown=reply.content,
            exact=bool(result.token_ids),
        )
        chain.history.append(sampled)
        self._shown.add(sampled)
        self.last_conversation, self.messages_cut = capped_conversation(
            [*messages, {"role": "assistant", "content": result.text}], self._message_budget
        )
        if self.on_call is not None:
            self.on_call(turn, result)
        return result

    def note_left_out(self, kinds: Sequence[str]) -> None:
        """One call's tools that the gateway left out of what the model sees (their types)."""
        for kind in dict.fromkeys(kinds):
            self.tools_left_out[kind] = self.tools_left_out.get(kind, 0) + 1

    def report(self) -> dict[str, Any]:
        """For the result's details: what the gateway changed of the program's calls."""
        report: dict[str, Any] = {"calls": self.calls, "clamped_calls": self.clamped_calls}
        if self.tools_left_out:
            report["tools_left_out"] = dict(self.tools_left_out)
        if self.clamped:
            report["clamped"] = self.clamped
        if self.messages_cut:
            report["messages_cut"] = self.messages_cut
        return report

    def token_chains(self) -> list[TokenChain]:
        """Every chain with tokens (token backends), in the order they started, except that the
        chain of the latest answered call comes last (what a trajectory's top-level fields hold)."""
        chains = []
        ordered = [c for c in self.chains if c is not self.last_chain]
        ordered += [self.last_chain] if self.last_chain is not None else []
        for chain in ordered:
            token_ids, loss_mask, logprobs = chain.session.token_trajectory()
            if token_ids:
                spans = chain.session.turn_spans()
                chains.append(
                    TokenChain(token_ids, loss_mask, logprobs, list(chain.versions), list(chain.calls), spans)
                )
        return chains


@dataclass(frozen=True)
class TokenChain:
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    calls: list[int]
    """The job's call numbers merged into this chain."""
    turn_spans: list[tuple[int, int]]
    """(start, end) of each merged call's sampled ids."""


CUT_MARK = "\n[... {} characters cut by the gateway to keep the result readable ...]\n"


def _size(message: Message) -> int:
    return len(json.dumps(message, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))


def _cut(text: str, keep: int) -> tuple[str, int]:
    """`text` with its middle cut out to about `keep` characters, the cut marked."""
    if len(text) <= keep:
        return text, 0
    head, tail = keep // 2, keep - keep // 2
    cut = len(text) - head - tail
    return text[:head] + CUT_MARK.format(cut) + text[len(text) - tail :], cut


def capped_conversation(messages: Sequence[Message], budget: int) -> tuple[list[Message], dict[str, int]]:
    """The messages in at most about `budget` bytes of JSON: each message's text cut to an eighth
    of it (its middle out, marked), then, while still over, the oldest messages after the first
    dropped (the first is the task, the last the reply). Returns them and what was cut."""
    per_message = max(budget // 8, 1024)
    kept: list[Message] = []
    cut_chars = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and len(content) > per_message:
            content, cut = _cut(content, per_message)
            cut_chars += cut
            message = {**message, "content": content}
        else:
            message = message.copy()
        kept.append(message)
    sizes = [_size(m) for m in kept]
    total, dropped = sum(sizes), 0
    while total > budget and len(kept) > 2:
        total -= sizes.pop(1)
        kept.pop(1)
        dropped += 1
    if total > budget:  # one or two messages of huge tool calls: their text only
        kept = [{"role": str(m.get("role", "")), "content": str(m.get("content") or "")[:per_message]} for m in kept]
        cut_chars += sum(max(s - _size(m), 0) for s, m in zip(sizes, kept, strict=False))
    report = {}
    if dropped:
        report["messages_dropped"] = dropped
    if cut_chars:
        report["characters_cut"] = cut_chars
    return kept, report
