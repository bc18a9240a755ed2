"""Model families for the token-exactness matrix: real chat templates, real special tokens.

Each family is one real Hugging Face chat template from tests/data/chat_templates
(provenance in SOURCES.md and models.json there) with the model's own
tokenizer settings from models.json: BOS and EOS, the stop tokens of
generation_config.json's `eos_token_id`, and the control tokens the template
writes. Real tokenizer.json files are not available offline, so the tokenizer
is a small byte-level BPE trained on a little text that carries exactly those
special tokens: the same shape of tokenizer, not the same vocabulary.

Each family also says how its model writes a tool call (its parser and a
function that writes a call in the native format) and, for reasoning models,
how a reply with thinking looks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "chat_templates"
MODELS = {entry["file"]: entry for entry in json.loads((TEMPLATES / "models.json").read_text())}

# Added tokens that are not "special" in the real tokenizers (kept on decode either way).
PLAIN_ADDED = {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}

# Control tokens the models sample that their templates do not write.
EXTRA_TOKENS = {
    "meta-llama--Llama-3.1-8B-Instruct.jinja": ["<|end_of_text|>"],
    "meta-llama--Llama-3.2-3B-Instruct.jinja": ["<|end_of_text|>"],
    "openai--gpt-oss-120b.jinja": ["<|startoftext|>", "<|endoftext|>"],
    "google--gemma-3-4b-it.jinja": ["<eos>", "<pad>"],
    "microsoft--Phi-4-mini-instruct.jinja": ["<|tool_call|>", "<|/tool_call|>"],
    "moonshotai--Kimi-K2-Instruct.jinja": ["[BOS]", "[EOS]", "[PAD]"],
    "Qwen--Qwen3-0.6B.jinja": ["<|endoftext|>"],
    "Qwen--Qwen2.5-7B-Instruct.jinja": ["<|endoftext|>"],
    "CohereForAI--c4ai-command-r-plus.jinja": ["<PAD>"],
    "NousResearch--Hermes-2-Pro-Llama-3-8B.jinja": ["<|end_of_text|>"],
    "microsoft--Phi-3.5-mini-instruct.jinja": ["<s>"],
}

# Families whose tokenizer.json post-processor prepends the BOS (which a chat must not double).
BOS_POSTPROCESSOR = {
    "meta-llama--Llama-3.1-8B-Instruct.jinja",
    "meta-llama--Llama-3.2-3B-Instruct.jinja",
    "mistralai--Mistral-7B-Instruct-v0.3.jinja",
    "deepseek-ai--DeepSeek-R1-Distill-Qwen-32B.jinja",
    "google--gemma-3-4b-it.jinja",
    "CohereForAI--c4ai-command-r-plus.jinja",
    "NousResearch--Hermes-2-Pro-Llama-3-8B.jinja",
    "mistralai--Mistral-Nemo-Instruct-2407.jinja",
    "microsoft--Phi-3.5-mini-instruct.jinja",
    "deepseek-ai--DeepSeek-V3.1.jinja",
}

CORPUS = """The quick brown fox jumps over the lazy dog. You are a helpful assistant.
Call the echo tool with some text, then call finish with your answer. The answer is 4.
{"name": "echo", "arguments": {"text": "hi"}} {"type": "function", "function": {"name": "finish"}}
Let me think about this step by step. Okay, so the user wants me to check the result first.
Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024 Environment: ipython
"""


def _hermes(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _llama(name: str, arguments: dict[str, Any]) -> str:
    return json.dumps({"name": name, "parameters": arguments})


def _mistral(name: str, arguments: dict[str, Any]) -> str:
    return "[TOOL_CALLS] " + json.dumps([{"name": name, "arguments": arguments}])


def _pythonic(name: str, arguments: dict[str, Any]) -> str:
    return "[" + name + "(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in arguments.items()) + ")]"


def _deepseek(name: str, arguments: dict[str, Any]) -> str:
    return (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"  # noqa: RUF001
        + name
        + "\n```json\n"
        + json.dumps(arguments)
        + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"  # noqa: RUF001
    )


def _harmony(name: str, arguments: dict[str, Any]) -> str:
    return (
        "<|channel|>analysis<|message|>I should use the tool.<|end|>"
        f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
        + json.dumps(arguments)
    )


def _kimi(name: str, arguments: dict[str, Any]) -> str:
    return (
        f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>"
        + json.dumps(arguments)
        + "<|tool_call_end|><|tool_calls_section_end|>"
    )


def _deepseek_v31(name: str, arguments: dict[str, Any]) -> str:
    return (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"  # noqa: RUF001
        + name
        + "<｜tool▁sep｜>"  # noqa: RUF001
        + json.dumps(arguments)
        + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"  # noqa: RUF001
    )


def _glm45(name: str, arguments: dict[str, Any]) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in arguments.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def _cohere(name: str, arguments: dict[str, Any]) -> str:
    return "Action: ```json\n" + json.dumps([{"tool_name": name, "parameters": arguments}], indent=4) + "\n```"


def _granite(name: str, arguments: dict[str, Any]) -> str:
    return "<|tool_call|>" + json.dumps([{"name": name, "arguments": arguments}])


def _phi4(name: str, arguments: dict[str, Any]) -> str:
    return "<|tool_call|>" + json.dumps([{"name": name, "arguments": arguments}]) + "<|/tool_call|>"


@dataclass(frozen=True)
class Family:
    name: str
    file: str
    parser: str
    call: Callable[[str, dict[str, Any]], str]
    stop: str
    """The end-of-turn token the model samples after a reply."""
    call_stop: str = ""
    """The one it samples after a tool call, when another (gpt-oss `<|call|>`, Llama `<|eom_id|>`)."""
    think: Callable[[str], str] = lambda text: ""
    """A reasoning prefix in the model's own format ("" for models that do not reason)."""
    plain: Callable[[str], str] = lambda text: text
    """A final answer without a tool call, in the model's own format."""
    malformed: str = ""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_role: bool = True
    hint_mark: str = ""
    """Text of the family's own call layout that its format-error hint must show."""
    tool_wrap: str = ""
    """How the template writes a tool result ("{}" for its text), as read off the template by hand."""
    user_wrap: str = ""
    """How the template writes a later user message ("{}" for its text)."""
    once: tuple[str, ...] = ()
    """Text the template writes once per conversation, which must never repeat in the trajectory."""
    role_stops: tuple[str, ...] = ()
    """Stop tokens that are also role tags: the model may sample one before another message's tag."""

    @property
    def model(self) -> dict[str, Any]:
        return MODELS[self.file]

    def special_tokens(self) -> list[str]:
        model = self.model
        tokens = [*model["template_special_tokens"], *model["stop_tokens"], *EXTRA_TOKENS.get(self.file, [])]
        tokens += [model[key] for key in ("bos_token", "eos_token", "pad_token") if model.get(key)]
        return list(dict.fromkeys(tokens))

    def write_tokenizer(self, folder: Path) -> Path:
        """A Hugging Face tokenizer folder: tokenizer.json, tokenizer_config.json, generation_config.json."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

        tokens = self.special_tokens()
        special = [t for t in tokens if t not in PLAIN_ADDED]
        plain = [t for t in tokens if t in PLAIN_ADDED]
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=700,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        corpus = [*CORPUS.splitlines(), *(TEMPLATES / self.file).read_text().splitlines()]
        tokenizer.train_from_iterator(corpus, trainer)
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
        model = self.model
        bos = model.get("bos_token")
        if self.file in BOS_POSTPROCESSOR and bos:
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
            )
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(folder / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": (TEMPLATES / self.file).read_text(),
            "bos_token": bos,
            "eos_token": model["eos_token"],
            "pad_token": model.get("pad_token"),
            "model_max_length": 131072,
        }
        if model.get("add_bos_token") is not None:
            config["add_bos_token"] = model["add_bos_token"]
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        eos_ids = [tokenizer.token_to_id(t) for t in model["stop_tokens"]]
        (folder / "generation_config.json").write_text(
            json.dumps({"eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0]})
        )
        return folder

    def script(self) -> list[tuple[str, bool]]:
        """Six replies as the model would sample them: (text including its stop token, hit the stop)."""
        call_stop = self.call_stop or self.stop
        return [
            # a tool call after some reasoning
            (self.think("The user wants the echo tool first.") + self.call("echo", {"text": "hi"}) + call_stop, True),
            # no tool call at all, trailing whitespace, no reasoning block
            (self.plain("The answer is 4.  \n") + self.stop, True),
            # a malformed call
            (self.think("Try again.") + self.malformed + call_stop, True),
            # cut by max_tokens in the middle of reasoning (no stop token)
            (self.think("Let me think about this step by step")[:-12] or "Let me think about this step", False),
            # a call followed by a newline
            (self.call("echo", {"text": "again"}) + "\n" + call_stop, True),
            # the final answer
            (self.think("Done.") + self.call("finish", {"answer": "4"}) + call_stop, True),
        ]


def _qwen_think(text: str) -> str:
    return f"<think>\n{text}\n</think>\n\n"


def _r1_think(text: str) -> str:
    return f"{text}\n</think>\n\n"  # the generation prompt ends in <think>\n


def _harmony_final(text: str) -> str:
    return f"<|channel|>final<|message|>{text}"


FAMILIES = [
    Family(
        "qwen3-thinking",
        "Qwen--Qwen3-0.6B.jinja",
        "hermes",
        _hermes,
        "<|im_end|>",
        think=_qwen_think,
        malformed='<tool_call>\n{"name": "echo", "arguments": {"text": }\n</tool_call>',
        hint_mark="<tool_call>",
    ),
    Family(  # `</think>` followed by one newline, not the two the template writes
        "qwen3-thinking-one-newline",
        "Qwen--Qwen3-0.6B.jinja",
        "hermes",
        _hermes,
        "<|im_end|>",
        think=lambda text: f"<think>\n{text}\n</think>\n",
        malformed='<tool_call>\n{"name": "echo", "arguments": {"text": }\n</tool_call>',
        hint_mark="<tool_call>",
    ),
    Family(
        "qwen3-no-thinking",
        "Qwen--Qwen3-0.6B.jinja",
        "hermes",
        _hermes,
        "<|im_end|>",
        malformed='<tool_call>\n{"name": "echo", "arguments": {"text": }\n</tool_call>',
        template_kwargs={"enable_thinking": False},
        hint_mark="<tool_call>",
    ),
    Family(
        "qwen2.5",
        "Qwen--Qwen2.5-7B-Instruct.jinja",
        "hermes",
        _hermes,
        "<|im_end|>",
        malformed='<tool_call>\n{"name": "echo" "arguments": {}}\n</tool_call>',
        hint_mark="<tool_call>",
    ),
    Family(
        "llama3.1",
        "meta-llama--Llama-3.1-8B-Instruct.jinja",
        "llama3_json",
        _llama,
        "<|eot_id|>",
        call_stop="<|eom_id|>",
        malformed='{"name": "echo", "parameters": {"text": }',
        hint_mark='"parameters"',
    ),
    Family(
        "llama3.2",
        "meta-llama--Llama-3.2-3B-Instruct.jinja",
        "llama3_json",
        _llama,
        "<|eot_id|>",
        malformed='{"name": "echo", "parameters": {"text": }',
        hint_mark='"parameters"',
    ),
    Family(
        "mistral-v0.3",
        "mistralai--Mistral-7B-Instruct-v0.3.jinja",
        "mistral",
        _mistral,
        "</s>",
        malformed='[TOOL_CALLS] [{"name": "echo", "arguments": {"text": }]',
        hint_mark="[TOOL_CALLS]",
    ),
    Family(
        "deepseek-r1-distill",
        "deepseek-ai--DeepSeek-R1-Distill-Qwen-32B.jinja",
        "deepseek_v3",
        _deepseek,
        "<｜end▁of▁sentence｜>",  # noqa: RUF001
        think=_r1_think,
        malformed="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>echo\n{oops",  # noqa: RUF001
        hint_mark="<｜tool▁sep｜>",  # noqa: RUF001
    ),
    Family(
        "gpt-oss",
        "openai--gpt-oss-120b.jinja",
        "openai",
        _harmony,
        "<|return|>",
        call_stop="<|call|>",
        plain=_harmony_final,
        malformed='<|channel|>commentary to=functions.echo <|constrain|>json<|message|>{"text": ',
        hint_mark="to=functions.",
    ),
    Family(
        "gemma3",
        "google--gemma-3-4b-it.jinja",
        "pythonic",
        _pythonic,
        "<end_of_turn>",
        malformed='[echo(text="hi"]',
        tool_role=False,
        hint_mark="TOOL(",
    ),
    Family(
        "phi4-mini",
        "microsoft--Phi-4-mini-instruct.jinja",
        "llama3_json",
        _phi4,
        "<|end|>",
        malformed='<|tool_call|>[{"name": "echo", "arguments": {"text": }]<|/tool_call|>',
    ),
    Family(
        "kimi-k2",
        "moonshotai--Kimi-K2-Instruct.jinja",
        "kimi_k2",
        _kimi,
        "<|im_end|>",
        malformed="<|tool_calls_section_begin|><|tool_call_begin|>functions.echo:0 {oops<|tool_calls_section_end|>",
        hint_mark="<|tool_call_begin|>",
    ),
    Family(
        "smollm2",
        "HuggingFaceTB--SmolLM2-135M-Instruct.jinja",
        "hermes",
        _hermes,
        "<|im_end|>",
        malformed='<tool_call>{"name": "echo", "arguments": {"text": }</tool_call>',
        hint_mark="<tool_call>",
    ),
    # Families whose templates the first matrix did not cover (each catches a class of failure).
    Family(  # declares tools unconditionally; no end-of-turn after an Action; a closing instruction turn
        "command-r-plus",
        "CohereForAI--c4ai-command-r-plus.jinja",
        "cohere",
        _cohere,
        "<|END_OF_TURN_TOKEN|>",
        malformed='Action: ```json\n[{"tool_name": "echo", "parameters": {"text": }]\n```',
        hint_mark='"tool_name"',
        tool_wrap="<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><results>\n{}</results><|END_OF_TURN_TOKEN|>",
        user_wrap="<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{}<|END_OF_TURN_TOKEN|>",
        once=("Write 'Action:' followed by a json-formatted list",),
    ),
    Family(  # declares tools unconditionally
        "hermes-2-pro",
        "NousResearch--Hermes-2-Pro-Llama-3-8B.jinja",
        "hermes",
        _hermes,
        "<|im_end|>",
        malformed='<tool_call>\n{"name": "echo", "arguments": {"text": }\n</tool_call>',
        hint_mark="<tool_call>",
        tool_wrap="<|im_start|>tool\n<tool_response>\n{}\n</tool_response><|im_end|>",
        user_wrap="<|im_start|>user\n{}<|im_end|>",
    ),
    Family(
        "mistral-nemo",
        "mistralai--Mistral-Nemo-Instruct-2407.jinja",
        "mistral",
        lambda name, arguments: "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": arguments}]),
        "</s>",
        malformed='[TOOL_CALLS][{"name": "echo", "arguments": {"text": }]',
        hint_mark="[TOOL_CALLS]",
        tool_wrap='[TOOL_RESULTS]{{"content": {}, "call_id": "',
        user_wrap="[INST]{}[/INST]",
    ),
    Family(  # no tool role; <|assistant|> is a stop id and the generation prompt's tag
        "phi3.5-mini",
        "microsoft--Phi-3.5-mini-instruct.jinja",
        "hermes",
        _hermes,
        "<|end|>",
        malformed='<tool_call>\n{"name": "echo", "arguments": {"text": }\n</tool_call>',
        tool_role=False,
        hint_mark="<tool_call>",
        user_wrap="<|user|>\n{}<|end|>",
        role_stops=("<|assistant|>",),
    ),
    Family(  # joins argument strings; tool outputs in its own markers; no parser before
        "deepseek-v3.1",
        "deepseek-ai--DeepSeek-V3.1.jinja",
        "deepseek_v31",
        _deepseek_v31,
        "<｜end▁of▁sentence｜>",  # noqa: RUF001
        malformed="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>echo<｜tool▁sep｜>"  # noqa: RUF001
        '{"text": <｜tool▁call▁end｜><｜tool▁calls▁end｜>',  # noqa: RUF001
        hint_mark="<｜tool▁call▁begin｜>TOOL<｜tool▁sep｜>",  # noqa: RUF001
        tool_wrap="<｜tool▁output▁begin｜>{}<｜tool▁output▁end｜>",  # noqa: RUF001
        user_wrap="<｜User｜>{}",  # noqa: RUF001
    ),
    Family(  # read by llama3_json before, with Llama's layout in its hint
        "granite-3.3",
        "ibm-granite--granite-3.3-2b-instruct.jinja",
        "granite",
        _granite,
        "<|end_of_text|>",
        malformed='<|tool_call|>[{"name": "echo", "arguments": {"text": }]',
        hint_mark="<|tool_call|>[",
        tool_wrap="<|start_of_role|>tool<|end_of_role|>{}<|end_of_text|>",
        user_wrap="<|start_of_role|>user<|end_of_role|>{}<|end_of_text|>",
    ),
    Family(  # no end-of-turn after a reply: the model's stop token is the next role tag
        "glm-4.5",
        "zai-org--GLM-4.5.jinja",
        "glm45",
        _glm45,
        "<|user|>",
        call_stop="<|observation|>",
        think=lambda text: f"\n<think>{text}</think>\n",
        malformed="<tool_call>echo\n<arg_key>text</arg_key>\n<arg_value>hi",
        hint_mark="<arg_key>",
        tool_wrap="<|observation|>\n<tool_response>\n{}\n</tool_response>",
        user_wrap="<|user|>\n{}",
        role_stops=("<|user|>", "<|observation|>"),
    ),
    Family(  # no tool role; ChatML with <|im_sep|>, no newline between turns
        "phi4",
        "microsoft--phi-4.jinja",
        "hermes",
        _hermes,
        "<|im_end|>",
        malformed='<tool_call>\n{"name": "echo", "arguments": {"text": }\n</tool_call>',
        tool_role=False,
        hint_mark="<tool_call>",
        user_wrap="<|im_start|>user<|im_sep|>{}<|im_end|>",
    ),
]
