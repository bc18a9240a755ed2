"""The runtime's end of the HTTP relay (wire.OP_RELAY, the operation named "gateway" on the wire).

That operation (on a connection of its own) makes the runtime listen for HTTP on the
sandbox's own loopback and relay each request to the server on that connection,
which becomes a relay channel: frames {wire.EXCHANGE: k, wire.TYPE: ...} both ways, k naming one
exchange (one HTTP request and its response).
  runtime -> server: "request" (method, path, headers [[name, value], ...], body_b64);
                     "cancel" (the program went away before the response ended).
  server -> runtime: "response" (status, headers), any number of "chunk" (data_b64),
                     then "end" ("error" set: the body broke off, the program's
                     connection is cut instead of ending the body properly).
Either side closing the connection closes the listener (then the connection) and
every connection the program had open to it.
"""

import base64
import collections
import json
import os
import select
import socket
import threading
import time

from . import wire
from .http_request import (
    DIGITS,
    HOP_BY_HOP,
    HTTP_TOKEN,
    RELAY_MAX_BODY,
    UNSAFE_TEXT,
    HttpError,
    api_of,
    peer_gone,
    read_http_request,
    reason_phrase,
    send_error,
    set_cloexec,
)
from .wire import HEADER, encode_frame, errno_of, recv_frame

RELAY_HOSTS = ("127.0.0.1", "::1")
RELAY_MAX_BUFFERED = 64 << 20
"""Response bytes (base64) received for one exchange and not yet written to the program:
a program that reads slower than the server sends past this has its exchange cut."""
RELAY_IDLE_S = 300.0
RELAY_POLL_S = 0.25
"""While a response is awaited, the program's connection is looked at this often (EOF: cancel)."""
RELAY_FLUSH_BYTES = 1 << 20
"""Response bytes gathered before a write even when more have arrived."""
RELAY_BODY_SLICE = 3 << 20  # a multiple of 3: base64 of the slices joined is that of the whole


class RelayExchange:
    """The frames the server sent for one exchange, waiting for its program's connection."""

    def __init__(self):
        self.cond = threading.Condition()
        self.frames = collections.deque()
        self.buffered = 0

    def put(self, frame, size=0):
        """Queue `frame`; False (and the exchange cut) when too much is waiting."""
        with self.cond:
            self.buffered += size
            if self.buffered > RELAY_MAX_BUFFERED:
                self.frames.clear()
                self.frames.append(({wire.TYPE: "overflow"}, 0))
                self.cond.notify()
                return False
            self.frames.append((frame, size))
            self.cond.notify()
            return True

    def get(self, timeout):
        with self.cond:
            if not self.frames:
                self.cond.wait(timeout)
            if not self.frames:
                return None
            frame, size = self.frames.popleft()
            self.buffered -= size
            return frame


class Relay:
    """A loopback HTTP listener relaying to the server over `conn` (see above).

    Threads: the connection's own (read_loop: frames from the server), one accepting,
    one per program connection. Every fd it opens is close-on-exec, so nothing the
    agent starts inherits them."""

    def __init__(self, conn, send_lock, max_body=RELAY_MAX_BODY):
        self.conn = conn
        self.send_lock = send_lock
        self.max_body = max_body
        self.lock = threading.Lock()
        self.exchanges = {}
        self.counter = 0
        self.clients = set()
        self.listeners = []
        self.closed = False
        self.acceptor = None
        self.wake_r, self.wake_w = os.pipe()
        set_cloexec(self.wake_r)
        set_cloexec(self.wake_w)

    # --- listening

    def bind(self, port):
        """Listen on 127.0.0.1:port (0: any free port), and on [::1] at the same port when
        there is IPv6; returns (port, hosts)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((RELAY_HOSTS[0], port))
            listener.listen(128)
        except BaseException:
            listener.close()
            raise
        self.listeners.append(listener)
        bound = listener.getsockname()[1]
        hosts = [RELAY_HOSTS[0]]
        try:
            listener6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            try:
                listener6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                listener6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener6.bind((RELAY_HOSTS[1], bound))
                listener6.listen(128)
            except BaseException:
                listener6.close()
                raise
            self.listeners.append(listener6)
            hosts.append(RELAY_HOSTS[1])
        except (OSError, AttributeError):
            pass  # no IPv6 here, or its port is taken: IPv4 only
        for item in self.listeners:
            set_cloexec(item.fileno())
            item.setblocking(False)  # accept never blocks the loop that also waits for close
        return bound, hosts

    def accept_loop(self):
        poller = select.poll()
        for item in self.listeners + [self.wake_r]:
            poller.register(item, select.POLLIN)
        by_fd = dict((item.fileno(), item) for item in self.listeners)
        try:
            while True:
                try:
                    events = poller.poll()
                except InterruptedError:
                    continue
                for fd, _ in events:
                    if fd == self.wake_r:
                        return
                    try:
                        client, _ = by_fd[fd].accept()
                    except BlockingIOError:  # aborted before it was accepted
                        continue
                    except OSError:  # out of fds: breathe, go on
                        time.sleep(0.05)
                        continue
                    set_cloexec(client.fileno())
                    try:
                        threading.Thread(target=self.serve_client, args=(client,), daemon=True).start()
                    except RuntimeError:  # no thread to be had: refuse this connection
                        client.close()
        finally:
            for item in self.listeners:
                item.close()

    # --- frames to the server

    def send(self, message, body=None):
        """One frame; with `body`, it is base64-encoded into the frame's body_b64 in slices,
        never all at once in memory. Nothing is sent once the relay is closed."""
        if body is None:
            data, parts = encode_frame(message), ()
        else:
            text = json.dumps(message)
            head = (text[:-1] + (", " if len(text) > 2 else "") + '"body_b64": "').encode("utf-8")
            size = len(head) + 4 * ((len(body) + 2) // 3) + 2
            data = HEADER.pack(size) + head
            parts = range(0, len(body), RELAY_BODY_SLICE)
        with self.send_lock:
            if self.closed:
                return
            try:
                self.conn.sendall(data)
                if body is not None:
                    view = memoryview(body)
                    for start in parts:
                        self.conn.sendall(base64.b64encode(view[start : start + RELAY_BODY_SLICE]))
                    self.conn.sendall(b'"}')
            except OSError:
                pass

    def cancel(self, number):
        self.forget(number)
        self.send({wire.EXCHANGE: number, wire.TYPE: wire.RELAY_CANCEL})

    def forget(self, number):
        with self.lock:
            self.exchanges.pop(number, None)

    # --- frames from the server

    def read_loop(self):
        """Route the server's frames to their exchanges until it closes the connection."""
        try:
            while True:
                frame = recv_frame(self.conn)
                if frame is None:
                    return
                if not isinstance(frame, dict):
                    continue
                number = frame.get(wire.EXCHANGE)
                with self.lock:
                    exchange = self.exchanges.get(number)
                if exchange is None:
                    continue  # cancelled, or long over
                data = frame.get("data_b64")
                if not exchange.put(frame, len(data) if isinstance(data, str) else 0):
                    self.cancel(number)
        except (OSError, ValueError):
            return

    def close(self):
        """Stop listening (joined: the port is free once this returns), cut every program
        connection and exchange, send nothing more."""
        with self.send_lock:
            with self.lock:
                self.closed = True
                exchanges = list(self.exchanges.values())
                self.exchanges.clear()
                clients = list(self.clients)
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass
        if self.acceptor is not None:
            self.acceptor.join()
        else:
            for item in self.listeners:
                item.close()
        for exchange in exchanges:
            exchange.put({wire.TYPE: "closed"})
        for client in clients:
            try:
                client.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        os.close(self.wake_r)
        os.close(self.wake_w)

    # --- the program's connections

    def serve_client(self, sock):
        with self.lock:
            if self.closed:
                sock.close()
                return
            self.clients.add(sock)
        reader = None
        try:
            sock.settimeout(RELAY_IDLE_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each write goes out at once
            reader = sock.makefile("rb")
            while self.serve_request(sock, reader):
                pass
            if not self.closed:  # let what the program still sends drain, so it reads our answer
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(1.0)
                for _ in range(64):
                    if not sock.recv(1 << 16):
                        break
        except Exception:  # noqa: BLE001 - a program's connection never takes the runtime down
            pass
        finally:
            with self.lock:
                self.clients.discard(sock)
            try:
                if reader is not None:
                    reader.close()
            except Exception:
                pass
            sock.close()

    def serve_request(self, sock, reader):
        """Serve one request; whether the connection stays open for the next."""
        try:
            request = read_http_request(reader, sock, self.max_body)
        except HttpError as exc:
            send_error(sock, exc.status, exc.message, exc.api)
            return False
        except (OSError, ValueError):  # reset, timed out, closed under it
            return False
        if request is None:
            return False
        method, path, version, headers, body, keep = request
        with self.lock:
            if self.closed:
                exchange = None
            else:
                self.counter += 1
                number = self.counter
                exchange = self.exchanges[number] = RelayExchange()
        if exchange is None:
            send_error(sock, 503, "the gateway is closed", api_of(path))
            return False
        try:
            message = {
                wire.EXCHANGE: number,
                wire.TYPE: wire.RELAY_REQUEST,
                "method": method,
                "path": path,
                "headers": headers,
            }
            self.send(message, body)
            del request, body
            return self.relay_response(sock, exchange, number, method, version, keep, api_of(path))
        finally:
            self.forget(number)

    def next_frame(self, sock, exchange, number):
        """The server's next frame for this exchange; None (and the server told to cancel)
        once the program has gone."""
        while True:
            frame = exchange.get(RELAY_POLL_S)
            if frame is not None:
                return frame
            if peer_gone(sock):
                self.cancel(number)
                return None

    def relay_response(self, sock, exchange, number, method, version, keep, api="openai"):
        """Write the server's response to exchange `number` to the program; whether its
        connection may carry another request."""
        frame = self.next_frame(sock, exchange, number)
        if frame is None:
            return False
        kind = frame.get(wire.TYPE)
        status = frame.get("status")
        if kind != wire.RELAY_RESPONSE or not isinstance(status, int) or not 200 <= status <= 599:
            if kind == wire.RELAY_RESPONSE or kind not in ("closed", "overflow"):
                self.cancel(number)
                send_error(sock, 502, "the server sent a malformed response", api)
            return False
        head, mode, length, keep = response_head(frame, status, method, version, keep)
        ended = False
        # What is written is gathered while more of it has already arrived, and sent as soon
        # as nothing more is there: a piece never waits for the next one, and a whole
        # response that came at once goes out in one write.
        pending = [head]
        try:
            if mode == "none":  # no body to send: the server need not produce it
                sock.sendall(pending[0])
                self.cancel(number)
                return keep
            written = 0
            while True:
                frame = exchange.get(0) if pending else None
                if frame is None:
                    if pending:
                        sock.sendall(b"".join(pending))
                        pending = []
                    frame = self.next_frame(sock, exchange, number)
                    if frame is None:
                        return False
                kind = frame.get(wire.TYPE)
                if kind == wire.RELAY_CHUNK:
                    data = base64.b64decode(frame.get("data_b64") or "")
                    if mode == "length":
                        data = data[: length - written]
                    if data:
                        pending.append(b"%x\r\n%s\r\n" % (len(data), data) if mode == "chunked" else data)
                        written += len(data)
                    if sum(len(item) for item in pending) >= RELAY_FLUSH_BYTES:
                        sock.sendall(b"".join(pending))
                        pending = []
                    continue
                ended = True
                if kind != wire.RELAY_END or frame.get("error"):
                    if pending and kind == wire.RELAY_END:  # what came before the break, then the cut
                        sock.sendall(b"".join(pending))
                    return False  # the body broke off: cut the connection, the program sees it unfinished
                if mode == "chunked":
                    pending.append(b"0\r\n\r\n")
                sock.sendall(b"".join(pending))
                return keep and (mode != "length" or written == length)
        except (OSError, ValueError, TypeError):
            if not ended:
                self.cancel(number)
            return False


def response_head(frame, status, method, version, keep):
    """The status line and headers the program gets for a `response` frame, and how its body
    is delimited: (head bytes, mode, Content-Length or None, keep-alive). Mode: "none" (HEAD,
    204, 304), "length" (one Content-Length the server gave), "chunked" (HTTP/1.1), else
    "close" (the end of the body is the end of the connection). Headers that are not tokens
    and hop-by-hop headers are dropped; control characters in values become spaces."""
    lines = []
    lengths = set()
    for pair in frame.get("headers") or []:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            continue
        name, value = str(pair[0]), str(pair[1])
        if not HTTP_TOKEN.fullmatch(name):
            continue
        if name.lower() == "content-length":
            lengths.add(value.strip())
        if name.lower() not in HOP_BY_HOP:
            lines.append("%s: %s\r\n" % (name, UNSAFE_TEXT.sub(" ", value)))
    length = int(next(iter(lengths))) if len(lengths) == 1 and DIGITS.fullmatch(next(iter(lengths))) else None
    if method == "HEAD" or status in (204, 304):
        mode = "none"
    elif length is not None:
        mode = "length"
    elif version == "HTTP/1.1":
        mode = "chunked"
    else:
        mode, keep = "close", False
    if length is not None and mode in ("length", "none") and status not in (204, 304):
        lines.append("Content-Length: %d\r\n" % length)
    if mode == "chunked":
        lines.append("Transfer-Encoding: chunked\r\n")
    if not keep:
        lines.append("Connection: close\r\n")
    head = "HTTP/1.1 %d %s\r\n%s\r\n" % (status, reason_phrase(status), "".join(lines))
    return head.encode("latin-1", "replace"), mode, length, keep


def serve_relay(conn, send_lock, request):
    """Serve the relay's opening `request` on `conn`, which is the relay channel from the answer on, until the
    server closes it; False (the connection stays an ordinary one) when it could not listen."""
    max_body = request.get("max_body")
    if not isinstance(max_body, int) or isinstance(max_body, bool) or not 0 < max_body <= RELAY_MAX_BODY:
        max_body = RELAY_MAX_BODY
    relay = Relay(conn, send_lock, max_body)
    try:
        port, hosts = relay.bind(int(request.get("port") or 0))
        with send_lock:  # the answer goes out before any request frame
            relay.acceptor = threading.Thread(target=relay.accept_loop, daemon=True)
            relay.acceptor.start()
            conn.sendall(encode_frame({wire.ID: request.get(wire.ID), wire.OK: True, "port": port, "hosts": hosts}))
    except Exception as exc:
        started = relay.acceptor is not None and relay.acceptor.is_alive()
        if not started:
            relay.acceptor = None
        relay.close()
        if started:
            return True  # the answer could not be sent: the connection is gone
        reply = {wire.ID: request.get(wire.ID), wire.OK: False, wire.ERROR: "%s: %s" % (type(exc).__name__, exc)}
        reply[wire.ERRNO] = errno_of(exc)
        with send_lock:
            try:
                conn.sendall(encode_frame(reply))
            except OSError:
                return True
        return False
    try:
        relay.read_loop()
    finally:
        relay.close()
    return True
