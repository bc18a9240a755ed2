"""The model gateway: the providers' HTTP APIs on top of one job's `chat` (a `RelayHandler`).

Routes (each also without the `/v1` prefix; a query string is ignored):

    POST /v1/chat/completions         OpenAI Chat Completions   (openai_chat.py)
    POST /v1/responses                OpenAI Responses          (openai_responses.py)
    GET  /v1/models[/{model}]         OpenAI's model list; Anthropic's when the request has an
                                      `anthropic-version` header
    POST /v1/messages                 Anthropic Messages        (anthropic_messages.py)
    POST /v1/messages/count_tokens    a rough estimate          (anthropic_messages.py)
    POST /v1beta/models/{model}:generateContent, :streamGenerateContent, :countTokens
    GET  /v1beta/models[/{model}]     Google's Gemini API       (google_generate.py)
    GET, HEAD /                       200: a client's probe that the server is up

Errors are in the format of the route's provider: Anthropic's `{"type": "error", "error":
{"type", "message"}}` on /v1/messages*, Google's `{"error": {"code", "message", "status"}}` on
the Gemini routes, OpenAI's `{"error": {"message", "type", "param", "code"}}` elsewhere (an
unknown path: 404; a known path with another method: 405). With an `api_key`, OpenAI routes need
`Authorization: Bearer <key>`, Anthropic routes `x-api-key: <key>` and Google routes
`x-goog-api-key: <key>` (or a `key` query parameter), each also the Bearer header: 401
otherwise.

The job's errors: ContextLengthExceeded -> 400 (OpenAI code `context_length_exceeded`; Anthropic
invalid_request_error "prompt is too long: ..."); LLMError llm_unavailable and Unavailable -> 503;
an LLMError about the request (llm_prompt: the history was rewritten under a token backend;
llm_bad_request: the backend refused it) -> 400; other LLMErrors -> 502; InvalidArgument and
other policy errors -> 400; ResourceExhausted -> 429; anything unexpected -> 500 (logged).
Cancellation (the program closed its connection) propagates: it is never turned into a response.

Limits (gateway settings, per job): at most `max_concurrent_calls` model calls at once (one
more: 429 at once, nothing queued); a body over `max_request_bytes`: 413. `admit` answers both
(and a bad key) from a request's head, before its body is read or decoded (the relay and the
gateway port call it). The body is parsed and dropped at once: a call holds its parsed
request, not also the bytes it came in.

The turn is awaited before any response starts, streams included, so every failure is a status.
The gateway records nothing: the `chat` it is given does.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

import structlog

from prorl_server.config import GatewaySettings
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
from prorl_server.gateway import anthropic_messages, google_generate, openai_chat, openai_responses
from prorl_server.gateway.common import ChatTurns, GatewayError, json_response, parse_body
from prorl_server.llm.base import ChatFn, Sampling
from prorl_server.sandbox.runtime.relay import HttpRequest, HttpResponse

log = structlog.get_logger(__name__)

DEFAULT_MODEL = "prorl"

Route = Callable[[HttpRequest], Awaitable[HttpResponse]]
MODEL_CALLS = ("/chat/completions", "/responses", "/messages")
"""The routes whose calls count against gateway.max_concurrent_calls (and Google's generate
methods, google_generate.MODEL_CALLS)."""
OPENAI, ANTHROPIC, GOOGLE = "openai", "anthropic", "google"
"""Whose format a route speaks (errors and keys)."""


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


def _content_length(request: HttpRequest) -> int | None:
    raw = request.headers.get("content-length", "").split(",")[0].strip()
    return int(raw) if raw.isdigit() else None


def _bearer(request: HttpRequest) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class ModelGateway:
    """One job's model endpoint: callable as a `RelayHandler`."""

    def __init__(
        self,
        chat: ChatFn,
        *,
        default_sampling: Sampling,
        model: str = DEFAULT_MODEL,
        api_key: str | None = None,
        limits: GatewaySettings | None = None,
        on_left_out: Callable[[Sequence[str]], None] | None = None,
    ) -> None:
        """`on_left_out(kinds)`: told per call of the tools left out of what the model sees (hosted
        tools the gateway cannot run), for the job's record."""
        self.model = model
        self._api_key = api_key or None
        self.limits = limits or GatewaySettings()
        self._turns = ChatTurns(chat, model=model, default_sampling=default_sampling, on_left_out=on_left_out)
        self.in_flight = 0
        """Model calls under way (the concurrency limit counts these)."""

    @property
    def max_request_bytes(self) -> int:
        """The largest body of a call (the relay refuses a larger one before reading it)."""
        return self.limits.max_request_bytes

    @staticmethod
    def _where(request: HttpRequest) -> tuple[str, str]:
        """The route's path (without /v1) and whose format it speaks (OPENAI, ANTHROPIC, GOOGLE)."""
        path = urlsplit(request.path).path.rstrip("/") or "/"
        if google_generate.is_google(path):
            return path, GOOGLE
        if path == "/v1" or path.startswith("/v1/"):
            path = path[3:] or "/"
        if google_generate.is_google(path):
            return path, GOOGLE
        flavor = ANTHROPIC if path == "/messages" or path.startswith("/messages/") else OPENAI
        if (path == "/models" or path.startswith("/models/")) and "anthropic-version" in request.headers:
            flavor = ANTHROPIC
        if path == "/":  # a probe: whichever provider's key header the client sends
            flavor = (
                ANTHROPIC
                if "x-api-key" in request.headers
                else GOOGLE
                if "x-goog-api-key" in request.headers
                else flavor
            )
        return path, flavor

    @staticmethod
    def _is_model_call(method: str, path: str, flavor: str) -> bool:
        if method.upper() != "POST":
            return False
        if flavor == GOOGLE:
            match = google_generate.ROUTE.match(path)
            return match is not None and match["method"] in google_generate.MODEL_CALLS
        return path in MODEL_CALLS

    def admit(self, request: HttpRequest) -> HttpResponse | None:
        """The refusal of a request from its head alone (method, path, headers; its body not yet
        read): a bad key (401) or a declared body over the limit (413). None: read the body."""
        path, flavor = self._where(request)
        try:
            self._authenticate(request, flavor=flavor)
            self._check_size(_content_length(request))
            if self._is_model_call(request.method, path, flavor):
                self._check_concurrency()
        except GatewayError as error:
            return self._error(error, flavor=flavor)
        return None

    def _check_concurrency(self) -> None:
        if self.in_flight >= self.limits.max_concurrent_calls:
            raise GatewayError(
                429,
                f"this job already has {self.in_flight} model calls under way, the most it may have "
                "at once (setting gateway.max_concurrent_calls): retry when one has ended",
                kind="rate_limit",
            )

    def _check_size(self, size: int | None) -> None:
        limit = self.limits.max_request_bytes
        if size is not None and size > limit:
            raise GatewayError(
                413,
                f"the request body has {size} bytes; this gateway takes at most {limit} per call "
                "(setting gateway.max_request_bytes): send a shorter conversation",
                kind="too_large",
            )

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        path, flavor = self._where(request)
        try:
            self._authenticate(request, flavor=flavor)
            self._check_size(len(request.body))
            route = self._route(request.method.upper(), path, flavor=flavor)
            return await route(request)
        except GatewayError as error:
            return self._error(error, flavor=flavor)
        except ProrlError as exc:
            return self._error(error_for(exc), flavor=flavor)
        except Exception as exc:
            log.exception("gateway_internal_error", method=request.method, path=path)
            internal = GatewayError(500, f"internal error: {type(exc).__name__}: {exc}", kind="api_error")
            return self._error(internal, flavor=flavor)

    def _error(self, error: GatewayError, *, flavor: str) -> HttpResponse:
        if flavor == ANTHROPIC:
            body = anthropic_messages.error_body(error)
        elif flavor == GOOGLE:
            body = google_generate.error_body(error)
        else:
            body = openai_chat.error_body(error)
        return json_response(error.status, body)

    def _authenticate(self, request: HttpRequest, *, flavor: str) -> None:
        if self._api_key is None:
            return
        given = _bearer(request)
        if flavor == ANTHROPIC and given is None:
            given = request.headers.get("x-api-key") or None
        if flavor == GOOGLE and given is None:
            given = request.headers.get("x-goog-api-key") or None
            if given is None:
                keys = parse_qs(urlsplit(request.path).query).get("key") or [""]
                given = keys[0] or None
        if given is None:
            where = {
                ANTHROPIC: "an x-api-key header",
                GOOGLE: "an x-goog-api-key header",
            }.get(flavor, "an Authorization: Bearer <key> header")
            raise GatewayError(401, f"missing API key: send it in {where}", kind="authentication")
        if not hmac.compare_digest(given.encode(), self._api_key.encode()):
            message = {ANTHROPIC: "invalid x-api-key", GOOGLE: "API key not valid"}.get(
                flavor, "Incorrect API key provided"
            )
            raise GatewayError(401, message, kind="authentication")

    def _route(self, method: str, path: str, *, flavor: str) -> Route:
        if flavor == GOOGLE:
            return self._google_route(method, path)
        posts: dict[str, Callable[[dict[str, Any]], Awaitable[HttpResponse]]] = {
            "/chat/completions": lambda body: openai_chat.handle_chat_completions(self._turns, body),
            "/responses": lambda body: openai_responses.handle_responses(self._turns, body),
            "/messages": lambda body: anthropic_messages.handle_messages(self._turns, body),
            "/messages/count_tokens": self._count_tokens,
        }
        if path == "/messages/count_tokens" and method == "POST":

            async def count(request: HttpRequest) -> HttpResponse:
                return await self._count_tokens(parse_body(request.take_body()))

            return count
        if path in posts:
            if method != "POST":
                raise self._not_allowed(method, path, "POST")
            handler = posts[path]

            async def post(request: HttpRequest) -> HttpResponse:
                self._check_concurrency()
                self.in_flight += 1
                try:
                    return await handler(parse_body(request.take_body()))
                finally:
                    self.in_flight -= 1

            return post
        if path == "/" and method in ("GET", "HEAD"):  # a client's probe that the server is there (Claude Code)

            async def alive(request: HttpRequest) -> HttpResponse:
                return json_response(200, {"status": "ok"})

            return alive
        if path == "/models" or path.startswith("/models/"):
            if method != "GET":
                raise self._not_allowed(method, path, "GET")
            name = path.removeprefix("/models").removeprefix("/") or None
            models = anthropic_messages.handle_models if flavor == ANTHROPIC else openai_chat.handle_models

            async def get(request: HttpRequest) -> HttpResponse:
                return models(self._turns, name)

            return get
        raise GatewayError(404, f"Invalid URL ({method} /v1{path}): no such route", kind="not_found")

    def _google_route(self, method: str, path: str) -> Route:
        match = google_generate.ROUTE.match(path)
        if match is None:  # the model list
            if method != "GET":
                raise self._not_allowed(method, path, "GET")

            async def get(request: HttpRequest) -> HttpResponse:
                return google_generate.handle_models(self._turns, path)

            return get
        if method != "POST":
            raise self._not_allowed(method, path, "POST")
        if match["method"] == "countTokens":

            async def count(request: HttpRequest) -> HttpResponse:
                return google_generate.handle_count_tokens(parse_body(request.take_body()))

            return count
        if match["method"] not in google_generate.MODEL_CALLS:
            raise GatewayError(
                404,
                f"{path}: no such method (generateContent, streamGenerateContent and countTokens are served)",
                kind="not_found",
            )

        async def generate(request: HttpRequest) -> HttpResponse:
            self._check_concurrency()
            self.in_flight += 1
            try:
                body = parse_body(request.take_body())
                return await google_generate.handle_generate(self._turns, body, path=request.path)
            finally:
                self.in_flight -= 1

        return generate

    @staticmethod
    async def _count_tokens(body: dict[str, Any]) -> HttpResponse:
        return anthropic_messages.handle_count_tokens(body)

    @staticmethod
    def _not_allowed(method: str, path: str, allowed: str) -> GatewayError:
        return GatewayError(405, f"{method} is not allowed on /v1{path}: use {allowed}", kind="method_not_allowed")
