"""The live model gateways of a server's jobs, reachable from outside the sandboxes.

A job that runs an agent program opens a model gateway in its sandbox; the
same gateway is also served on the server's gateway port
(`server.gateway_port`) under `/jobs/<job_id>`, for harnesses that run beside
the sandbox. Each gateway checks its own per-job key; once the job's program
has ended, the gateway is gone from here and its key is refused.

`admit` answers from a request's head alone (the server's gateway port calls it before it reads
a body): an unknown job or a bad key is refused 401, a declared body over the job's limit 413,
with nothing of the body read.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from prorl_server.gateway.app import ModelGateway
from prorl_server.gateway.common import GatewayError, json_response
from prorl_server.gateway.openai_chat import error_body
from prorl_server.sandbox.runtime.relay import HttpRequest, HttpResponse

PREFIX = "/jobs/"


def job_path(job_id: str) -> str:
    """Where a job's gateway is on the gateway port (an OpenAI SDK's base URL adds /v1)."""
    return f"{PREFIX}{job_id}"


class GatewayDirectory:
    def __init__(self) -> None:
        self._live: dict[str, ModelGateway] = {}

    def add(self, job_id: str, gateway: ModelGateway) -> None:
        self._live[job_id] = gateway

    def remove(self, job_id: str) -> None:
        self._live.pop(job_id, None)

    def __len__(self) -> int:
        return len(self._live)

    def _target(self, request: HttpRequest) -> tuple[ModelGateway, HttpRequest] | HttpResponse:
        """The job's gateway and the request as it sees it (the rest of the path), or the 401."""
        target = urlsplit(request.path)
        job_id, _, rest = target.path.removeprefix(PREFIX).partition("/")
        gateway = self._live.get(job_id) if target.path.startswith(PREFIX) else None
        if gateway is None:
            # Unknown, finished, or not running a program: the same answer, so that keys and job
            # ids cannot be probed.
            refused = GatewayError(
                401,
                "no live model gateway at this path: the job is not running an agent program (finished, not "
                "started, or unknown), and its key died with it",
                kind="authentication",
                code="invalid_api_key",
            )
            return json_response(401, error_body(refused))
        query = f"?{target.query}" if target.query else ""
        return gateway, HttpRequest(request.method, f"/{rest}{query}", request.headers, request.take_body())

    def admit(self, request: HttpRequest) -> HttpResponse | None:
        """The refusal of a request from its head alone (see the module docstring); None: read on."""
        found = self._target(request)
        if isinstance(found, HttpResponse):
            return found
        gateway, inner = found
        return gateway.admit(inner)

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        """Route /jobs/<job_id>/... to that job's gateway, with the rest of the path."""
        found = self._target(request)
        if isinstance(found, HttpResponse):
            return found
        gateway, inner = found
        del request
        return await gateway(inner)
