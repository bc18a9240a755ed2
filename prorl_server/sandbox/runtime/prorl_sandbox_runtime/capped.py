"""Output capping: what a tool returns is at most its cap, its head and tail kept.

A command may print gigabytes; the runtime keeps the first and last bytes within the
request's `max_output_bytes` and says that it cut (`truncated`).
"""

DEFAULT_CAP = 64 * 1024


class CappedBuffer:
    """Keeps the head and a rolling tail of a stream, never all of it."""

    def __init__(self, limit):
        self.half = max(limit // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def write(self, data):
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 4 * self.half:
                del self.tail[: len(self.tail) - self.half]

    @property
    def truncated(self):
        return self.total > 2 * self.half

    def text(self):
        head = bytes(self.head).decode("utf-8", "replace")
        if not self.truncated:
            return head + bytes(self.tail).decode("utf-8", "replace")
        tail = bytes(self.tail[-self.half :])
        omitted = self.total - len(self.head) - len(tail)
        return "%s\n[... %d bytes of output truncated ...]\n%s" % (
            head,
            omitted,
            tail.decode("utf-8", "ignore"),
        )


def capped(text, limit):
    """A CappedBuffer holding `text` (any str, lone surrogates of odd file names included)."""
    buffer = CappedBuffer(limit)
    buffer.write(text.encode("utf-8", "surrogateescape"))
    return buffer
