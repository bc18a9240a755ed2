"""One settings model per backend: the config file and AddBackend validate into the same
BackendSettings, and every wrong field of an AddBackend message is named in its InvalidArgument."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import pytest

from prorl_client import v1
from prorl_server import config
from prorl_server.api.admin_servicer import AdminServicer
from prorl_server.api.backend_messages import ADDABLE_KINDS, KIND_NAMES, backend_to_proto, settings_from_proto
from prorl_server.config import ConfigError, load_settings
from prorl_server.errors import InvalidArgument
from prorl_server.llm.administration import LocalAdministration
from prorl_server.llm.backend_settings import (
    BACKEND_KINDS,
    SERVED_KINDS,
    BackendKind,
    BackendSettings,
    ToolCallParser,
)
from prorl_server.llm.base import TOOL_CALL_PARSERS
from prorl_server.llm.factory import backend_info
from prorl_server.llm.router import BackendEntry, BackendRouter
from tests.fakes.scripted_llm import ScriptedChatBackend
from tests.fakes.token_servers import write_tiny_tokenizer


def test_the_config_file_gives_the_same_model(tmp_path: Path) -> None:
    path = tmp_path / "prorl.toml"
    path.write_text(
        """
[[llm.backends]]
id = "qwen-0"
kind = "vllm"
base_url = "http://10.0.0.5:8000/v1/"
tokenizer_path = "/models/qwen"
api_key = "s3cret"
weight = 2.0
max_in_flight = 8
tool_call_parser = "hermes"
logprobs_mode = "raw"
chat_template_kwargs = { enable_thinking = false }
"""
    )
    (loaded,) = load_settings(path, environ={}).llm.backends
    assert type(loaded) is BackendSettings and config.BackendSettings is BackendSettings
    assert loaded == BackendSettings(
        id="qwen-0",
        kind="vllm",
        base_url="http://10.0.0.5:8000/v1",
        tokenizer_path="/models/qwen",
        api_key="s3cret",  # type: ignore[arg-type]
        weight=2.0,
        max_in_flight=8,
        logprobs_mode="raw",
        chat_template_kwargs={"enable_thinking": False},
    )
    assert "s3cret" not in repr(loaded)


@pytest.mark.parametrize(
    ("backend", "setting"),
    [
        ({"id": "a b"}, "llm.backends.0.id"),
        ({"kind": "embedded"}, "llm.backends.0.kind"),
        ({"base_url": "10.0.0.5:8000"}, "llm.backends.0.base_url"),
        ({"weight": 0}, "llm.backends.0.weight"),
        ({"max_in_flight": -1}, "llm.backends.0.max_in_flight"),
        ({"tool_call_parser": "nope"}, "llm.backends.0.tool_call_parser"),
        ({"logprobs_mode": "cooked"}, "llm.backends.0.logprobs_mode"),
        ({"kind": "sglang"}, "llm.backends.0.tokenizer_path"),
        ({"colour": "red"}, "llm.backends.0.colour"),
    ],
)
def test_a_wrong_backend_setting_stops_start_up_naming_it(backend: dict[str, Any], setting: str) -> None:
    overrides = {"llm": {"backends": [{"id": "a", "base_url": "http://x/v1", **backend}]}}
    with pytest.raises(ConfigError, match=re.escape(f"setting '{setting}'")):
        load_settings(None, environ={}, overrides=overrides)


def test_settings_are_immutable() -> None:
    settings = BackendSettings(id="a", base_url="http://x/v1")
    with pytest.raises(ValueError, match="frozen"):
        settings.kind = "vllm"


def test_kinds_and_parsers_are_written_once() -> None:
    assert BACKEND_KINDS == get_args(BackendKind) == ("openai_chat", "vllm", "sglang")
    assert get_args(ToolCallParser) == TOOL_CALL_PARSERS
    assert set(KIND_NAMES) == set(SERVED_KINDS) == {*BACKEND_KINDS, "embedded"}
    named = {value for value in v1.BackendKind.values() if value != v1.BACKEND_KIND_UNSPECIFIED}
    assert set(KIND_NAMES.values()) == named
    assert sorted(ADDABLE_KINDS.values()) == sorted(BACKEND_KINDS)


def test_an_add_backend_message_becomes_settings(tmp_path: Path) -> None:
    message = v1.Backend(
        id="v-1",
        kind=v1.BACKEND_KIND_VLLM,
        base_url="https://h:8000/v1/",
        model="m",
        api_key="k",
        max_in_flight=4,
        tokenizer_path="/tok",
        weight=0.5,
        tool_call_parser="kimi_k2",
        logprobs_mode=v1.LOGPROBS_MODE_RAW,
    )
    message.chat_template_kwargs.update({"enable_thinking": False})
    settings = settings_from_proto(message)
    assert settings.model_dump(exclude={"api_key"}) == {
        "id": "v-1",
        "kind": "vllm",
        "base_url": "https://h:8000/v1",
        "model": "m",
        "max_in_flight": 4,
        "tokenizer_path": "/tok",
        "weight": 0.5,
        "tool_call_parser": "kimi_k2",
        "chat_template_kwargs": {"enable_thinking": False},
        "logprobs_mode": "raw",
    }
    assert settings.api_key.get_secret_value() == "k"


def test_unset_proto_fields_keep_their_documented_defaults() -> None:
    settings = settings_from_proto(v1.Backend(id="c", kind=v1.BACKEND_KIND_OPENAI_CHAT, base_url="http://x/v1"))
    assert (settings.weight, settings.tool_call_parser, settings.logprobs_mode) == (1.0, "hermes", "processed")
    assert (settings.max_in_flight, settings.tokenizer_path, settings.chat_template_kwargs) == (0, "", {})


def test_what_list_backends_shows_reads_back_as_the_same_settings() -> None:
    settings = BackendSettings(
        id="s", kind="sglang", base_url="http://x:30000", tokenizer_path="/tok", weight=3, logprobs_mode="raw"
    )
    backend = ScriptedChatBackend([])
    backend.info = backend_info(settings)
    shown = backend_to_proto(BackendEntry(backend))
    assert shown.kind == v1.BACKEND_KIND_SGLANG and shown.api_key == "" and shown.state.healthy
    assert settings_from_proto(shown) == settings


def valid(**fields: Any) -> v1.Backend:
    values: dict[str, Any] = {"id": "b", "kind": v1.BACKEND_KIND_OPENAI_CHAT, "base_url": "http://x/v1", **fields}
    return v1.Backend(**values)


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        (valid(id=""), "backend.id: use 1-64 characters of A-Z a-z 0-9 . _ : -"),
        (valid(id="a b"), "backend.id: use 1-64 characters"),
        (valid(id="x" * 65), "backend.id: use 1-64 characters"),
        (valid(kind=v1.BACKEND_KIND_UNSPECIFIED), "backend.kind: BACKEND_KIND_UNSPECIFIED cannot be added"),
        (valid(kind=v1.BACKEND_KIND_EMBEDDED), "backend.kind: BACKEND_KIND_EMBEDDED cannot be added"),
        (valid(kind=99), "backend.kind: 99 cannot be added; use one of BACKEND_KIND_OPENAI_CHAT"),
        (valid(base_url="ftp://x"), "backend.base_url: must start with http:// or https://"),
        (valid(base_url=""), "backend.base_url: must start with http:// or https://"),
        (valid(weight=-1), "backend.weight: input should be greater than 0; unset or 0 means 1 (got -1.0)"),
        (valid(max_in_flight=-1), "backend.max_in_flight: input should be greater than or equal to 0"),
        (valid(tool_call_parser="nope"), "backend.tool_call_parser: input should be 'hermes'"),
        (valid(kind=v1.BACKEND_KIND_VLLM), "backend.tokenizer_path: kind vllm needs tokenizer_path"),
        (valid(kind=v1.BACKEND_KIND_SGLANG), "backend.tokenizer_path: kind sglang needs tokenizer_path"),
    ],
)
def test_each_wrong_field_is_named(message: v1.Backend, problem: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        settings_from_proto(message)
    assert problem in raised.value.message
    assert raised.value.message.startswith("backend.")


def test_every_wrong_field_is_named_at_once() -> None:
    with pytest.raises(InvalidArgument) as raised:
        settings_from_proto(v1.Backend(id="a b", kind=v1.BACKEND_KIND_VLLM, base_url="x", max_in_flight=-2))
    named = [part.split(":")[0] for part in raised.value.message.split("; ")]
    assert named == ["backend.id", "backend.base_url", "backend.max_in_flight", "backend.tokenizer_path"]


def test_an_unknown_logprobs_mode_value_reads_as_processed() -> None:
    assert settings_from_proto(valid(logprobs_mode=7)).logprobs_mode == "processed"


def no_stats() -> Any:
    raise AssertionError("AddBackend reads no stats")


async def test_add_backend_validates_builds_and_adds(tmp_path: Path) -> None:
    pool = BackendRouter(health_interval_s=0)
    servicer = AdminServicer(pool, LocalAdministration(pool, request_timeout_s=1, max_retries=0), no_stats)
    with pytest.raises(InvalidArgument, match=r"backend\.base_url: "):
        await servicer.AddBackend(v1.AddBackendRequest(backend=valid(base_url="ftp://x")), None)  # type: ignore[arg-type]
    assert pool.entries() == []

    folder = write_tiny_tokenizer(tmp_path / "tok")
    request = v1.AddBackendRequest(
        backend=valid(id="v", kind=v1.BACKEND_KIND_VLLM, tokenizer_path=str(folder), api_key="k")
    )
    response = await servicer.AddBackend(request, None)  # type: ignore[arg-type]
    assert response.backend.id == "v" and response.backend.tokenizer_path == str(folder)
    assert response.backend.api_key == "" and [e.id for e in pool.entries()] == ["v"]
    await pool.close()
