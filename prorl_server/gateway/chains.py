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
gateway only removes tool-call markup). The chain then sends the
sampled text in its place, so the template renders what the model really
produced. Anything else (an edited reply, a changed message, other tools) is
a rewritten history: a new chain.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prorl_server.errors import LLMError
from prorl_server.gateway.common import read_reply
from prorl_server.llm.base import ChatResult, Sampling
from prorl_server.llm.job_chat import JobChat
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession

Message = dict[str, Any]


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


@dataclass
class _Reply:
    """A reply the model sampled, as the chain must send it again and recognise it."""

    text: str
    calls: list[tuple[str, Any]]
    """(name, arguments) of the tool calls the gateway gave for it."""

    def matches(self, echoed: Message) -> bool:
        if echoed.get("role") != "assistant":
            return False
        if self.calls != _call_keys(echoed.get("tool_calls")):
            return False
        return _text(echoed.get("content")).strip() in self.text

    def as_sent(self, echoed: Message) -> Message:
        """The sampled text, with the program's tool calls (their ids are what its tool results name)."""
        message: Message = {"role": "assistant", "content": self.text}
        if echoed.get("tool_calls"):
            message["tool_calls"] = echoed["tool_calls"]
        return message


@dataclass
class Chain:
    session: LLMSession
    tools_key: str
    history: list[Message | _Reply] = field(default_factory=list)
    """The program's messages so far, with the model's replies in their place."""
    awaiting: bool = False
    """The last call got no reply (it failed, or was cancelled): only the same call again (a
    resend) may continue the chain."""
    in_flight: bool = False
    """A call is under way: no other call joins the chain meanwhile (not even an identical one:
    calls side by side are separate samples)."""
    calls: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Per token: the policy version of the call that added it."""

    def continuation(self, messages: Sequence[Message]) -> list[Message] | None:
        """The messages to send on this chain for `messages`, or None if they do not extend it."""
        known = len(self.history)
        if self.in_flight or len(messages) < known or (self.awaiting and len(messages) != known):
            return None
        sent: list[Message] = []
        for mine, theirs in zip(self.history, messages, strict=False):
            if isinstance(mine, _Reply):
                if not mine.matches(theirs):
                    return None
                sent.append(mine.as_sent(theirs))
            elif _key(mine) != _key(theirs):
                return None
            else:
                sent.append(mine)
        return sent + [dict(m) for m in messages[known:]]


class CallChains:
    """The chains of one job's gateway calls; `chat` is what the gateway calls."""

    def __init__(
        self,
        job_id: str,
        router: BackendRouter,
        *,
        on_call: Callable[[int, ChatResult], None] | None = None,
        min_policy_version: int = 0,
    ) -> None:
        """`on_call(number, result)` is told of every call that got its reply (the recorder)."""
        self._job_id = job_id
        self._min_policy_version = min_policy_version
        self._router = router
        self.on_call = on_call
        self.chains: list[Chain] = []
        self.calls = 0
        self.last_conversation: list[Message] = []
        """The latest call's messages and its reply, as the program sent them and the model wrote it."""
        self.last_chain: Chain | None = None
        self.outage: LLMError | None = None
        """The backends' failure on the latest call, when no call succeeded since: the program could
        not reach the model (the job fails as infrastructure, not as the policy's doing)."""

    def _chain_for(self, messages: Sequence[Message], tools_key: str) -> tuple[Chain, list[Message]]:
        for chain in reversed(self.chains):
            if chain.tools_key != tools_key:
                continue
            sent = chain.continuation(messages)
            if sent is not None:
                return chain, sent
        session = LLMSession(
            self._job_id, self._router, job_chat=JobChat(native_tools=True), min_policy_version=self._min_policy_version
        )
        chain = Chain(session, tools_key)
        self.chains.append(chain)
        return chain, [dict(m) for m in messages]

    async def chat(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        """One model call of the program, on the chain it extends (or a new one)."""
        tools_key = json.dumps(list(tools), sort_keys=True, default=str)
        # No await before `in_flight` is set: calls made side by side go to separate chains.
        chain, sent = self._chain_for(messages, tools_key)
        turn = self.calls
        self.calls += 1
        chain.awaiting = chain.in_flight = True
        chain.history += [dict(m) for m in messages[len(chain.history) :]]
        try:
            result = await chain.session.chat(sent, tools, sampling)
        except LLMError as exc:  # the backends' failure (a full context is the policy's, not an LLMError)
            self.outage = exc
            raise
        finally:
            chain.in_flight = False
        self.outage = None
        chain.awaiting = False
        # Every token not yet versioned is this call's: its prompt (also one a failed attempt sent)
        # and its sample.
        chain.versions += [result.policy_version] * (len(chain.session.token_trajectory()[0]) - len(chain.versions))
        chain.calls.append(turn)
        self.last_chain = chain
        reply = read_reply(result, parse_calls=bool(tools), id_prefix=f"c{turn}")  # as the gateway answers
        chain.history.append(_Reply(result.text, [(call.name, call.arguments) for call in reply.calls]))
        self.last_conversation = [*[dict(m) for m in messages], {"role": "assistant", "content": result.text}]
        if self.on_call is not None:
            self.on_call(turn, result)
        return result

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
