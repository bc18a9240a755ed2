"""Reading an HTTP/1.1 request from a program in the sandbox, and answering one with an
error in the shape of the API it called (OpenAI, Anthropic or Google): the relay's
parsing half, strict on sizes and syntax before anything reaches the server.
"""

import fcntl
import http
import json
import re
import select
import socket

RELAY_MAX_BODY = 64 << 20
"""A larger request body is refused with 413 (the server may ask for less: `max_body`), from its
declared length before any of it is read, or as soon as a chunked body grows past it."""
RELAY_MAX_LINE = 65536
RELAY_MAX_HEADERS = 100
RELAY_MAX_HEADER_BYTES = 256 << 10
HOP_BY_HOP = frozenset(
    [
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    ]
)
"""The response fields that stop at a hop, dropped from a handler's answer by the sandbox's relay
and by the gateway port alike (the one list both use): the hop-by-hop fields of RFC 7230
section 6.1 (Connection, Keep-Alive, Proxy-Authenticate, Proxy-Authorization, TE, Trailer,
Transfer-Encoding, Upgrade, as RFC 2616 section 13.5.1 lists them) and Proxy-Connection (RFC
9110 section 7.6.1), plus Content-Length: each end frames the body it sends itself."""
# Matched with fullmatch (`$` would let a trailing newline through).
HTTP_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
HTTP_VERSION = re.compile(r"HTTP/[0-9]\.[0-9]")
HEX_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")
DIGITS = re.compile(r"[0-9]{1,18}")
UNSAFE_TEXT = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class HttpError(Exception):
    """A request the relay refuses: answered with `status`, then the connection is closed;
    in the error format of the request's API (`api`: see api_of)."""

    def __init__(self, status, message, api="openai"):
        Exception.__init__(self, message)
        self.status = status
        self.message = message
        self.api = api


ANTHROPIC_PATHS = ("/v1/messages", "/messages", "/v1/messages/count_tokens", "/messages/count_tokens")
# As the server's Gemini routes (gateway/google_generate.py ROUTE and LIST).
GOOGLE_PATH = re.compile(r"/(?:v1beta|v1alpha|v1)?/?models/[^/:]+:[A-Za-z]+|/(?:v1beta|v1alpha)/models(?:/[^/:]+)?")


def api_of(path):
    """Whose error format a request's path speaks: "anthropic", "google" or "openai"."""
    path = (path or "").split("?", 1)[0].rstrip("/")
    if path in ANTHROPIC_PATHS:
        return "anthropic"
    if GOOGLE_PATH.fullmatch(path):
        return "google"
    return "openai"


def _too_large(max_body, path):
    message = (
        "the request body is larger than %d bytes, the most this gateway takes per call "
        "(setting gateway.max_request_bytes): send a shorter conversation" % max_body
    )
    return HttpError(413, message, api_of(path))


def set_cloexec(fd):
    fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)


def reason_phrase(status):
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return ""


def _readable(fd, timeout_ms):
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_ms))


def peer_gone(sock):
    """Whether the program closed (or reset) its end of `sock`; data it sent is left unread."""
    try:
        if not _readable(sock.fileno(), 0):
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def _error_body(status, message, api):
    """The refusal in the error format of the request's API, as the server's gateway writes it."""
    if api == "anthropic":
        kind = "request_too_large" if status == 413 else "api_error" if status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": message}}
    if api == "google":
        name = "UNAVAILABLE" if status == 503 else "INTERNAL" if status >= 500 else "INVALID_ARGUMENT"
        return {"error": {"code": status, "message": message, "status": name}}
    if status == 413:
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": "request_too_large"}
        return {"error": error}
    return {"error": {"message": message, "type": "gateway_error"}}


def send_error(sock, status, message, api="openai"):
    body = json.dumps(_error_body(status, message, api)).encode("utf-8")
    head = "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (
        status,
        reason_phrase(status),
        len(body),
    )
    try:
        sock.sendall(head.encode("latin-1") + body)
    except OSError:
        pass


def _read_line(reader, what):
    line = reader.readline(RELAY_MAX_LINE + 1)
    if len(line) > RELAY_MAX_LINE:
        raise HttpError(431 if what == "header" else 414 if what == "request line" else 400, "%s too long" % what)
    if not line.endswith(b"\n"):
        raise HttpError(400, "incomplete %s" % what)
    return line


def _read_chunked(reader, max_body, path):
    body = bytearray()
    while True:
        line = _read_line(reader, "chunk size")
        size_text = line.split(b";", 1)[0].strip()
        if not HEX_SIZE.fullmatch(size_text):
            raise HttpError(400, "malformed chunk size")
        size = int(size_text, 16)
        if size == 0:
            break
        if len(body) + size > max_body:
            raise _too_large(max_body, path)
        data = reader.read(size)
        if data is None or len(data) < size:
            raise HttpError(400, "incomplete chunked body")
        body += data
        if _read_line(reader, "chunk") not in (b"\r\n", b"\n"):
            raise HttpError(400, "malformed chunk")
    for _ in range(RELAY_MAX_HEADERS + 1):  # trailers: read and dropped
        if _read_line(reader, "trailer") in (b"\r\n", b"\n"):
            return body
    raise HttpError(431, "too many trailers")


def _request_target(target):
    if not target or UNSAFE_TEXT.search(target) or " " in target or "\t" in target:
        raise HttpError(400, "malformed request target")
    if target.startswith("/") or target == "*":
        return target
    scheme, sep, rest = target.partition("://")
    if sep and scheme.lower() in ("http", "https"):  # absolute form: keep the path and query
        cut = min([i for i in (rest.find("/"), rest.find("?")) if i >= 0] or [len(rest)])
        path = rest[cut:]
        return path if path.startswith("/") else "/" + path
    raise HttpError(400, "malformed request target")


def read_http_request(reader, sock, max_body=RELAY_MAX_BODY):
    """One HTTP/1.x request from `reader` (the program's connection `sock`): (method, target,
    version, headers [[name, value], ...], body, keep_alive), or None at a clean EOF. A
    chunked body is returned whole, its headers then saying Content-Length instead. A body
    over `max_body` is refused (413) before it is read."""
    line = reader.readline(RELAY_MAX_LINE + 1)
    for _ in range(8):  # empty lines before a request are tolerated
        if line not in (b"\r\n", b"\n"):
            break
        line = reader.readline(RELAY_MAX_LINE + 1)
    if not line:
        return None
    if len(line) > RELAY_MAX_LINE:
        raise HttpError(414, "request line too long")
    if not line.endswith(b"\n"):
        raise HttpError(400, "incomplete request line")
    parts = line.decode("latin-1").rstrip("\r\n").split(" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if not HTTP_TOKEN.fullmatch(method):
        raise HttpError(400, "malformed method")
    if not HTTP_VERSION.fullmatch(version):
        raise HttpError(400, "malformed HTTP version")
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise HttpError(505, "only HTTP/1.0 and HTTP/1.1 are served")
    path = _request_target(target)
    try:
        return _read_rest(reader, sock, max_body, method, path, version)
    except HttpError as exc:  # refused in the format of the API the path names
        exc.api = api_of(path)
        raise


def _read_rest(reader, sock, max_body, method, path, version):
    """The headers and body of a request whose request line was read (see read_http_request)."""
    headers = []
    total = 0
    while True:
        line = _read_line(reader, "header")
        total += len(line)
        if total > RELAY_MAX_HEADER_BYTES:
            raise HttpError(431, "headers too large")
        if line in (b"\r\n", b"\n"):
            break
        if line[:1] in (b" ", b"\t"):
            raise HttpError(400, "folded header lines are not accepted")
        name, sep, value = line.decode("latin-1").rstrip("\r\n").partition(":")
        value = value.strip(" \t")
        if not sep or not HTTP_TOKEN.fullmatch(name) or UNSAFE_TEXT.search(value):
            raise HttpError(400, "malformed header")
        headers.append([name, value])
        if len(headers) > RELAY_MAX_HEADERS:
            raise HttpError(431, "too many headers")

    def values(wanted):
        return [v.strip().lower() for n, vs in headers if n.lower() == wanted for v in vs.split(",") if v.strip()]

    keep = version == "HTTP/1.1" and "close" not in values("connection")
    codings = values("transfer-encoding")
    if codings and codings != ["chunked"]:
        raise HttpError(501, "only the chunked transfer-encoding is served")
    length = 0
    if not codings and values("content-length"):
        lengths = set(values("content-length"))
        if len(lengths) != 1 or not DIGITS.fullmatch(next(iter(lengths))):
            raise HttpError(400, "malformed content-length")
        length = int(next(iter(lengths)))
        if length > max_body:
            raise _too_large(max_body, path)
    expect = values("expect")
    if expect:
        if expect != ["100-continue"]:
            raise HttpError(417, "only Expect: 100-continue is served")
        if version == "HTTP/1.1":
            sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if codings:
        body = _read_chunked(reader, max_body, path)
        headers = [h for h in headers if h[0].lower() not in ("transfer-encoding", "content-length")]
        headers.append(["Content-Length", str(len(body))])
    else:
        body = reader.read(length) if length else b""
        if body is None or len(body) < length:
            raise HttpError(400, "incomplete body")
    return method, path, version, headers, body, keep
