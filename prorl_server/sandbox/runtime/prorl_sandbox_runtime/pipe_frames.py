"""Frames over the judge's pipes to its children (the codec of wire.py), read with
deadlines and a size cap: a child that floods, stalls or writes garbage is a broken
protocol, never a hang of the judge.
"""

import json
import os
import select
import time

from . import wire
from .wire import HEADER

MAX_FRAME = wire.MAX_PIPE


class ProtocolError(Exception):
    """The other side sent something that is not a well-formed frame."""


def write_all(fd, data):
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class FrameReader:
    """Length-prefixed JSON frames from a pipe, read with deadlines and a size cap."""

    def __init__(self, fd, max_frame=MAX_FRAME):
        self.fd = fd
        self.max_frame = max_frame
        self.buffer = bytearray()
        self.eof = False

    def pop(self):
        """A complete buffered frame, or None."""
        if len(self.buffer) < HEADER.size:
            return None
        (size,) = HEADER.unpack(bytes(self.buffer[: HEADER.size]))
        if size > self.max_frame:
            raise ProtocolError("a frame of %d bytes (the limit is %d)" % (size, self.max_frame))
        if len(self.buffer) < HEADER.size + size:
            return None
        body = bytes(self.buffer[HEADER.size : HEADER.size + size])
        del self.buffer[: HEADER.size + size]
        try:
            message = json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise ProtocolError("a frame that is not JSON (%s)" % type(exc).__name__)
        if not isinstance(message, dict):
            raise ProtocolError("a frame that is not a JSON object")
        return message

    def fill(self, timeout):
        """Read what arrives within `timeout`; False once the pipe is at EOF."""
        if self.eof:
            return False
        ready, _, _ = select.select([self.fd], [], [], None if timeout is None else max(timeout, 0))
        if ready:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                self.eof = True
                return False
            self.buffer += chunk
        return True

    def read(self, deadline=None):
        """The next frame; None at EOF; raises Timeout at the deadline (None: wait)."""
        while True:
            message = self.pop()
            if message is not None:
                return message
            if self.eof:
                return None
            if deadline is None:
                self.fill(None)
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Timeout()
            self.fill(remaining)

    def drain(self, quiet_s, limit_s):
        """Read until EOF, until nothing arrives for quiet_s, or for at most limit_s."""
        deadline = time.monotonic() + limit_s
        while not self.eof and time.monotonic() < deadline and len(self.buffer) <= self.max_frame:
            ready, _, _ = select.select([self.fd], [], [], quiet_s)
            if not ready:
                return
            chunk = os.read(self.fd, 1 << 16)
            if chunk:
                self.buffer += chunk
            else:
                self.eof = True


class Timeout(BaseException):
    """The judging deadline passed (a BaseException: check() cannot swallow it)."""
