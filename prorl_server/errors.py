"""The server's exception tree.

Domain code raises these; `api/errors.py` maps each to a gRPC status code in
one place, so a client never sees a traceback.

    ProrlError               base; unexpected ones become INTERNAL
      InvalidArgument        the request is malformed      -> INVALID_ARGUMENT
      NotFound               unknown job or backend        -> NOT_FOUND
      PermissionDenied       refused by server policy      -> PERMISSION_DENIED
                             (e.g. an image not in sandbox.allowed_images)
      AlreadyExists          id reused for something else  -> ALREADY_EXISTS
      FailedPrecondition     wrong state for the call      -> FAILED_PRECONDITION
      ResourceExhausted      queue or pool full            -> RESOURCE_EXHAUSTED
        ConsumerTooSlow      a subscriber fell behind the event feed
      OutOfRange             a feed cursor behind retention -> OUT_OF_RANGE
      Unavailable            shutting down, retry later    -> UNAVAILABLE
      InfrastructureError    a dependency failed during a job (never sent to
        SandboxError         clients as a status: it becomes the job's
        LLMError             failure of kind INFRASTRUCTURE)
      PolicyError            the agent itself broke its rollout (a job failure
                             of kind POLICY):
        SandboxBroken        its commands broke their own sandbox: the runtime
                             killed (runtime_killed), stopped (runtime_stopped)
                             or cut off (runtime_socket_closed), a disk filled
                             (disk_full)
          SandboxLimitExceeded  or its own limits reached (pids_limit, e.g. a
                             fork bomb; memory_limit, a memory hog)
        ContextLengthExceeded  a conversation too long for the model (the loop
                             stops there)
"""

from __future__ import annotations


class ProrlError(Exception):
    """Base of every error the server raises on purpose."""

    reason = "internal"

    def __init__(self, message: str, *, reason: str | None = None, metadata: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        self.metadata = dict(metadata or {})
        """Sent to the client as trailing metadata beside the status (e.g. a cursor to resume from)."""


class InvalidArgument(ProrlError):
    reason = "invalid_argument"


class NotFound(ProrlError):
    reason = "not_found"


class PermissionDenied(ProrlError):
    """Well-formed, but this server's policy forbids it (another server may allow it)."""

    reason = "permission_denied"


class AlreadyExists(ProrlError):
    reason = "already_exists"


class FailedPrecondition(ProrlError):
    reason = "failed_precondition"


class ResourceExhausted(ProrlError):
    reason = "resource_exhausted"


class ConsumerTooSlow(ResourceExhausted):
    reason = "consumer_too_slow"


class OutOfRange(ProrlError):
    reason = "out_of_range"


class Unavailable(ProrlError):
    reason = "unavailable"


class InfrastructureError(ProrlError):
    """A dependency of a job (sandbox, LLM backend) failed, not the policy."""

    reason = "infrastructure"


class SandboxError(InfrastructureError):
    reason = "sandbox"


class LLMError(InfrastructureError):
    reason = "llm_unavailable"


class PolicyError(ProrlError):
    """The agent's own actions ended the rollout."""

    reason = "policy"


class SandboxBroken(PolicyError):
    """What the agent ran broke its own sandbox; `reason` says how (see the tree above).
    Only raised when the evidence rules out an outside cause (sandbox/blame.py)."""

    reason = "sandbox_broken"


class SandboxLimitExceeded(SandboxBroken):
    """The sandbox ran into its own pids or memory limit (reason pids_limit or memory_limit)."""

    reason = "sandbox_limit"


class ContextLengthExceeded(PolicyError):
    """The conversation no longer fits the model's context: the agent loop stops."""

    reason = "context_length"
