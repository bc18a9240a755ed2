"""The model gateway: the providers' HTTP APIs on top of one job's `chat` (a `GatewayHandler`).

Routes (each also without the `/v1` prefix; a query string is ignored):

    POST /v1/chat/completions         OpenAI Chat Completions   (openai_chat.py)
    POST /v1/responses                OpenAI Responses          (openai_responses.py)
    GET  /v1/models[/{model}]         OpenAI's model list; Anthropic's when the request has an
                                      `anthropic-version` header
    POST /v1/messages                 Anthropic Messages        (anthropic_messages.py)
    POST /v1/messages/count_tokens    a rough estimate          (anthropic_messages.py)

Errors are in the format of the route's provider: Anthropic's `{"type": "error", "error":
{"type", "message"}}` on /v1/messages*, OpenAI's `{"error": {"message", "type", "param", "code"}}`
elsewhere (an unknown path: 404; a known path with another method: 405). With an `api_key`,
OpenAI routes need `Authorization: Bearer <key>` and Anthropic routes `x-api-key: <key>` (or the
Bearer header): 401 otherwise.

The job's errors: ContextLengthExceeded -> 400 (OpenAI code `context_length_exceeded`; Anthropic
invalid_request_error "prompt is too long: ..."); LLMError llm_unavailable and Unavailable -> 503;
an LLMError about the request (llm_prompt: the history was rewritten under a token backend;
llm_bad_request: the backend refused it) -> 400; other LLMErrors -> 502; InvalidArgument and
other policy errors -> 400; ResourceExhausted -> 429; anything unexpected -> 500 (logged).
Cancellation (the program closed its connection) propagates: it is never turned into a response.

The turn is awaited before any response starts, streams included, so every failure is a status.
The gateway records nothing: the `chat` it is given does.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import structlog

from prorl_server.agents.base import ChatFn
from prorl_server.errors import (
    AlreadyExists,
    ContextLengthExceeded,
    InfrastructureError,
    LLMError,
    NotFound,
    PermissionDenied,
    PolicyError,
    ProrlError,
    ResourceExhausted,
    Unavailable,
)
from prorl_server.gateway import anthropic_messages, openai_chat, openai_responses
from prorl_server.gateway.common import ChatTurns, GatewayError, json_response, parse_body
from prorl_server.llm.base import Sampling
from prorl_server.sandbox.runtime.relay import HttpRequest, HttpResponse

log = structlog.get_logger(__name__)

DEFAULT_MODEL = "prorl"

Route = Callable[[HttpRequest], Awaitable[HttpResponse]]


def error_for(exc: ProrlError) -> GatewayError:
    """The HTTP error for an error of the job's chat."""
    message = exc.message
    if isinstance(exc, ContextLengthExceeded):
        return GatewayError(400, message, kind="context_length", param="messages")
    if isinstance(exc, LLMError):
        if exc.reason == "llm_unavailable":
            return GatewayError(503, f"the model is unavailable: {message}", kind="unavailable")
        if exc.reason in ("llm_prompt", "llm_bad_request"):
            return GatewayError(400, message)
        return GatewayError(502, f"the model failed: {message}", kind="api_error")
    if isinstance(exc, Unavailable):
        return GatewayError(503, message, kind="unavailable")
    if isinstance(exc, ResourceExhausted):
        return GatewayError(429, message, kind="rate_limit")
    if isinstance(exc, NotFound):
        return GatewayError(404, message, kind="not_found")
    if isinstance(exc, PermissionDenied):
        return GatewayError(403, message, kind="permission")
    if isinstance(exc, AlreadyExists):
        return GatewayError(409, message)
    if isinstance(exc, InfrastructureError):
        return GatewayError(500, message, kind="api_error")
    if isinstance(exc, PolicyError):
        return GatewayError(400, message)
    if exc.reason in ("invalid_argument", "failed_precondition"):
        return GatewayError(400, message)
    return GatewayError(500, message, kind="api_error")


def _bearer(request: HttpRequest) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class ModelGateway:
    """One job's model endpoint: callable as a `GatewayHandler`."""

    def __init__(
        self,
        chat: ChatFn,
        *,
        default_sampling: Sampling,
        model: str = DEFAULT_MODEL,
        api_key: str | None = None,
    ) -> None:
        self.model = model
        self._api_key = api_key or None
        self._turns = ChatTurns(chat, model=model, default_sampling=default_sampling)

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        path = urlsplit(request.path).path.rstrip("/") or "/"
        if path == "/v1" or path.startswith("/v1/"):
            path = path[3:] or "/"
        anthropic = path == "/messages" or path.startswith("/messages/")
        if path == "/models" or path.startswith("/models/"):
            anthropic = "anthropic-version" in request.headers
        try:
            self._authenticate(request, anthropic=anthropic)
            route = self._route(request.method.upper(), path, anthropic=anthropic)
            return await route(request)
        except GatewayError as error:
            return self._error(error, anthropic=anthropic)
        except ProrlError as exc:
            return self._error(error_for(exc), anthropic=anthropic)
        except Exception as exc:
            log.exception("gateway_internal_error", method=request.method, path=path)
            internal = GatewayError(500, f"internal error: {type(exc).__name__}: {exc}", kind="api_error")
            return self._error(internal, anthropic=anthropic)

    def _error(self, error: GatewayError, *, anthropic: bool) -> HttpResponse:
        body = anthropic_messages.error_body(error) if anthropic else openai_chat.error_body(error)
        return json_response(error.status, body)

    def _authenticate(self, request: HttpRequest, *, anthropic: bool) -> None:
        if self._api_key is None:
            return
        given = _bearer(request)
        if anthropic and given is None:
            given = request.headers.get("x-api-key") or None
        if given is None:
            where = "an x-api-key header" if anthropic else "an Authorization: Bearer <key> header"
            raise GatewayError(401, f"missing API key: send it in {where}", kind="authentication")
        if not hmac.compare_digest(given.encode(), self._api_key.encode()):
            message = "invalid x-api-key" if anthropic else "Incorrect API key provided"
            raise GatewayError(401, message, kind="authentication")

    def _route(self, method: str, path: str, *, anthropic: bool) -> Route:
        posts: dict[str, Callable[[dict[str, Any]], Awaitable[HttpResponse]]] = {
            "/chat/completions": lambda body: openai_chat.handle_chat_completions(self._turns, body),
            "/responses": lambda body: openai_responses.handle_responses(self._turns, body),
            "/messages": lambda body: anthropic_messages.handle_messages(self._turns, body),
            "/messages/count_tokens": self._count_tokens,
        }
        if path in posts:
            if method != "POST":
                raise self._not_allowed(method, path, "POST")
            handler = posts[path]

            async def post(request: HttpRequest) -> HttpResponse:
                return await handler(parse_body(request.body))

            return post
        if path == "/models" or path.startswith("/models/"):
            if method != "GET":
                raise self._not_allowed(method, path, "GET")
            name = path.removeprefix("/models").removeprefix("/") or None
            models = anthropic_messages.handle_models if anthropic else openai_chat.handle_models

            async def get(request: HttpRequest) -> HttpResponse:
                return models(self._turns, name)

            return get
        raise GatewayError(404, f"Invalid URL ({method} /v1{path}): no such route", kind="not_found")

    @staticmethod
    async def _count_tokens(body: dict[str, Any]) -> HttpResponse:
        return anthropic_messages.handle_count_tokens(body)

    @staticmethod
    def _not_allowed(method: str, path: str, allowed: str) -> GatewayError:
        return GatewayError(405, f"{method} is not allowed on /v1{path}: use {allowed}", kind="method_not_allowed")
