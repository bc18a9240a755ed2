"""Test doubles for code built on prorl: task families, bridges and plugins in their own packages.

- `FakeSandboxProvider`: sandboxes without Podman. Each is a temporary folder
  with the real in-sandbox runtime running as a host process on a Unix socket,
  so tools, the file editor and the judging harness behave as in a container
  (without its isolation: for tests only).
- `ScriptedChatBackend`: an in-process chat backend whose replies come from a
  script (a function of the messages, or a list of replies); `ScriptedLLMServer`
  serves such a script over real HTTP as an OpenAI-compatible server.
- `tool_call_text(name, arguments)`: a reply that calls a tool in the format
  the shipped families parse; `user_prompt(messages)` and `turn_index(messages)`
  help a script decide.

A family's test runs a real ProrlServer on them::

    from prorl_server.app import ProrlServer
    from prorl_server.config import load_settings
    from prorl_server.testing import FakeSandboxProvider, ScriptedChatBackend, ScriptedReply, tool_call_text

    backend = ScriptedChatBackend(lambda messages: ScriptedReply(tool_call_text("finish", {"answer": "42"})))
    settings = load_settings(None, environ={}, overrides={"server": {"port": 0}, "jobs": {"store": False},
                                                        "llm": {"embedded": {"enabled": "never"}}})
    server = ProrlServer(settings, sandbox_provider=FakeSandboxProvider(), backends=[backend])

docs/handlers.md ("A family in its own package") has the whole example.
"""

from prorl_server.testing.sandbox_provider import FakeContainer, FakeSandboxProvider
from prorl_server.testing.scripted_llm import (
    LoadableScriptedBackend,
    Script,
    ScriptedChatBackend,
    ScriptedLLMServer,
    ScriptedReply,
    api_tool_call,
    tool_call_text,
    turn_index,
    user_prompt,
)

__all__ = [
    "FakeContainer",
    "FakeSandboxProvider",
    "LoadableScriptedBackend",
    "Script",
    "ScriptedChatBackend",
    "ScriptedLLMServer",
    "ScriptedReply",
    "api_tool_call",
    "tool_call_text",
    "turn_index",
    "user_prompt",
]
