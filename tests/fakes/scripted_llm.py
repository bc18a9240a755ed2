"""The scripted LLMs now ship as prorl_server.testing.scripted_llm (for plugins' tests too)."""

from prorl_server.testing.scripted_llm import (  # noqa: F401
    ChatRequest,
    LoadableScriptedBackend,
    Replies,
    Script,
    ScriptedChatBackend,
    ScriptedLLMServer,
    ScriptedReply,
    api_tool_call,
    script_of,
    tool_call_text,
    turn_index,
    user_prompt,
)
