"""The runtime's frames and words, for both ends of the socket and the judge's pipes.

A frame is an 8-byte big-endian length and that many bytes of UTF-8 JSON. A
request is {"id": int, "op": str, ...fields}; its answer is {"id", "ok": true,
...result} or {"id", "ok": false, "error": str, "errno": int | null} when the
request itself could not be served. The HTTP relay's frames name their exchange
by "gw" and say what they are by "type" (see RELAY_*).

Imported by the in-sandbox runtime and judge (python3 3.8+, stdlib only) and by
the server (runtime/client.py, runtime/socket_relay.py), so the two ends
cannot drift apart. Typed for the server's strict checks, in syntax and imports that
3.5 still loads: the judge's runner children run on a SWE-bench testbed's own Python.
"""

import errno
import json
import struct
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:  # typing.Final is 3.8+: the runner children may run on a testbed's older Python
    from typing import Final  # noqa: F401

HEADER = struct.Struct(">Q")  # type: Final
"""The length prefix of every frame."""

MAX_REQUEST = 1 << 30  # type: Final
"""The largest frame the runtime reads from the server (a write_file of up to 768 MiB)."""
MAX_REPLY = 2 << 30  # type: Final
"""The largest answer the server reads from the runtime: a whole file of read_file's own
limit (1 GiB), base64-encoded."""
MAX_RELAY = 256 << 20  # type: Final
"""The largest HTTP relay frame the server reads (the runtime caps a request body at 64 MiB;
base64 and headers come on top)."""
MAX_PIPE = 64 << 20  # type: Final
"""The largest frame the judge reads from its children's pipes."""


class FrameTooLarge(ValueError):
    """A frame's length prefix is over the reader's limit: the other side is broken or hostile."""


def encode_frame(message: Mapping[str, Any], compact: bool = False) -> bytes:
    """`message` as one frame; `compact` drops the spaces after separators."""
    body = json.dumps(message, separators=(",", ":") if compact else None).encode("utf-8")
    return HEADER.pack(len(body)) + body


def frame_size(header: bytes, limit: int, what: str = "frame") -> int:
    """The body's length a frame's header announces; FrameTooLarge over `limit`."""
    (size,) = HEADER.unpack(header)
    if size > limit:
        raise FrameTooLarge("a %s of %d bytes is too large (the limit is %d)" % (what, size, limit))
    return int(size)


def decode_body(body: bytes) -> Any:
    """A frame's body: any JSON value (the callers check that it is an object)."""
    return json.loads(body.decode("utf-8"))


def recv_exact(sock: Any, size: int) -> Optional[bytes]:
    """Exactly `size` bytes from a blocking socket, or None at EOF."""
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: Any, limit: int = MAX_REQUEST) -> Any:
    """The next frame from a blocking socket, decoded; None at EOF; FrameTooLarge over `limit`."""
    header = recv_exact(sock, HEADER.size)
    if header is None:
        return None
    body = recv_exact(sock, frame_size(header, limit))
    return None if body is None else decode_body(body)


def errno_of(exc: BaseException) -> Optional[int]:
    """The errno an answer that failed carries (ERRNO), so the server can tell a sandbox out of
    pids, memory or disk (the agent's doing) from other failures."""
    if isinstance(exc, MemoryError):
        return errno.ENOMEM
    if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        return errno.EAGAIN
    number = getattr(exc, "errno", None)
    return number if isinstance(number, int) else None


# --- the words -------------------------------------------------------------------------

# Fields every request and answer carries.
ID = "id"  # type: Final
OP = "op"  # type: Final
OK = "ok"  # type: Final
ERROR = "error"  # type: Final
ERRNO = "errno"  # type: Final

# Operations: what `op` names. OP_RELAY ("gateway" on the wire, for the model gateway it
# serves) turns its connection into an HTTP relay channel.
OP_HEALTH = "health"  # type: Final
OP_BASH = "bash"  # type: Final
OP_PYTHON = "python"  # type: Final
OP_EDIT = "edit"  # type: Final
OP_READ_FILE = "read_file"  # type: Final
OP_WRITE_FILE = "write_file"  # type: Final
OP_LIST_DIR = "list_dir"  # type: Final
OP_RESET = "reset"  # type: Final
OP_JUDGE = "judge"  # type: Final
OP_RELAY = "gateway"  # type: Final
OPS = (OP_HEALTH, OP_BASH, OP_PYTHON, OP_EDIT, OP_READ_FILE, OP_WRITE_FILE, OP_LIST_DIR, OP_RESET, OP_JUDGE)
"""The operations of a runtime connection (OP_RELAY, the relay's opening, aside)."""

# Fields of a request the runtime reads whatever its op.
TIMEOUT_S = "timeout_s"  # type: Final
MAX_OUTPUT_BYTES = "max_output_bytes"  # type: Final

# The HTTP relay: every frame names its exchange by EXCHANGE and says what it is by TYPE.
EXCHANGE = "gw"  # type: Final
TYPE = "type"  # type: Final
RELAY_REQUEST = "request"  # type: Final
"""runtime -> server: method, path, headers [[name, value], ...], body_b64."""
RELAY_CANCEL = "cancel"  # type: Final
"""runtime -> server: the program went away before the response ended."""
RELAY_RESPONSE = "response"  # type: Final
"""server -> runtime: status, headers."""
RELAY_CHUNK = "chunk"  # type: Final
"""server -> runtime: data_b64, any number of them."""
RELAY_END = "end"  # type: Final
"""server -> runtime: the body is over ("error" set: it broke off)."""
