"""A real TCP proxy in front of a test server that reshapes streaming (SSE) responses by their
content: cut each stream after a set number of events, or delay it by a set time.

Why it decodes instead of relaying bytes: how the upstream's bytes arrive in recv() calls
depends on scheduling (a busy machine hands the proxy a whole stream in one read), so any rule
counted per read is a race. Here the upstream's HTTP chunked framing is decoded, the body is
split into complete SSE events, and each event goes to the client as one HTTP chunk of its
own; what the client receives depends only on the events.

One request per connection (the proxy sends `Connection: close` upstream and to the client),
so a cut never leaves a reusable connection behind. Non-SSE responses (health, model info,
/metrics, HTTP errors) pass through byte for byte, undelayed.
"""

from __future__ import annotations

import queue
import socket
import threading
import time

_EVENT_ENDS = (b"\r\n\r\n", b"\n\n")  # an SSE event ends with a blank line (CRLF or LF)
_HOP_BY_HOP = (b"connection", b"keep-alive", b"transfer-encoding", b"content-length")


class ProtocolError(Exception):
    pass


class _Reader:
    """Buffered reads from one socket."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            if not self._fill():
                raise ProtocolError(f"connection closed before {sep!r}")
        out, self.buf = self.buf.split(sep, 1)
        return out

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise ProtocolError(f"connection closed {n - len(self.buf)} bytes short")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def rest(self):
        if self.buf:
            yield self.buf
            self.buf = b""
        while data := self.sock.recv(65536):
            yield data


def _headers(head: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    first, *lines = head.split(b"\r\n")
    pairs = []
    for line in lines:
        name, _, value = line.partition(b":")
        pairs.append((name.strip(), value.strip()))
    return first, pairs


def _get(pairs, name: bytes) -> bytes | None:
    return next((v for k, v in pairs if k.lower() == name), None)


def _rebuild(first: bytes, pairs, extra: list[bytes]) -> bytes:
    kept = [k + b": " + v for k, v in pairs if k.lower() not in _HOP_BY_HOP]
    return b"\r\n".join([first, *kept, *extra]) + b"\r\n\r\n"


def _body_pieces(up: _Reader, pairs):
    """The upstream's response body as it arrives, HTTP chunked framing removed."""
    if (_get(pairs, b"transfer-encoding") or b"").lower() == b"chunked":
        while True:
            size = int(up.until(b"\r\n").split(b";")[0], 16)
            if size == 0:
                return
            yield up.exactly(size)
            up.exactly(2)  # the CRLF after each chunk's data
    else:
        yield from up.rest()


def sse_events(pieces):
    """Complete SSE events (terminator included) from body pieces cut anywhere."""
    buf = b""
    for piece in pieces:
        buf += piece
        while True:
            ends = [(i, len(sep)) for sep in _EVENT_ENDS if (i := buf.find(sep)) >= 0]
            if not ends:
                break
            i, n = min(ends)
            yield buf[:i + n]
            buf = buf[i + n:]
    # Bytes after the last blank line are no complete event: a client would drop them too.


def _is_done(event: bytes) -> bool:
    return event.strip() == b"data: [DONE]" or event.strip() == b"data:[DONE]"


class SSEProxy:
    """keep_events=N: send the first N events of each stream (never `data: [DONE]`), then close
    the connection without the chunked body's terminator, as a crashed server or a broken
    network would. first_byte_delay=T: the response head and every event leave T seconds after
    they arrived (no earlier; a late wake-up adds a little), so a client's TTFT through the
    proxy is T at least while the gaps between events stay the upstream's."""

    def __init__(self, upstream_port: int, *, keep_events: int | None = None, first_byte_delay: float = 0.0):
        self.upstream, self.keep, self.first_byte_delay = upstream_port, keep_events, first_byte_delay
        self.streams = 0  # SSE responses seen, so a test can tell that traffic went through here
        self._lock = threading.Lock()  # streams and errors change on connection threads
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.errors: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket):
        try:
            with client, socket.create_connection(("127.0.0.1", self.upstream)) as up:
                self._relay(client, _Reader(client), up)
        except (OSError, ProtocolError, ValueError) as e:
            # The client giving up is normal; anything else is reported through .errors.
            if not isinstance(e, (BrokenPipeError, ConnectionResetError)):
                with self._lock:
                    self.errors.append(f"{e.__class__.__name__}: {e}")

    def _relay(self, client: socket.socket, creader: _Reader, up: socket.socket):
        first, pairs = _headers(creader.until(b"\r\n\r\n"))
        if _get(pairs, b"transfer-encoding"):
            raise ProtocolError("chunked request bodies are not supported")
        body = creader.exactly(int(_get(pairs, b"content-length") or 0))
        up.sendall(_rebuild(first, pairs, [b"Content-Length: %d" % len(body), b"Connection: close"]) + body)

        ureader = _Reader(up)
        head = ureader.until(b"\r\n\r\n")
        arrived = time.monotonic()
        status, rpairs = _headers(head)
        if not (_get(rpairs, b"content-type") or b"").startswith(b"text/event-stream"):
            client.sendall(head + b"\r\n\r\n")
            for data in ureader.rest():
                client.sendall(data)
            return
        with self._lock:
            self.streams += 1
        # A reader thread stamps each event when it arrives, so that time spent here sleeping
        # for earlier events never shifts the schedule of later ones.
        events: queue.Queue = queue.Queue()
        reader = threading.Thread(target=self._read_events, args=(ureader, rpairs, events), daemon=True)
        reader.start()
        try:
            self._send_events(client, status, rpairs, arrived, events)
        finally:
            # Wake the reader (a cut leaves it in recv) and let it finish before the socket
            # closes: a descriptor closed under a blocked recv may be reused by another socket.
            try:
                up.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            reader.join()

    def _send_events(self, client: socket.socket, status: bytes, rpairs, arrived: float,
                     events: queue.Queue) -> None:
        self._sleep_until(arrived + self.first_byte_delay)
        client.sendall(_rebuild(status, rpairs, [b"Transfer-Encoding: chunked", b"Connection: close"]))
        k = 0
        while (item := events.get()) is not None:
            t, event = item
            if isinstance(event, Exception):
                raise event
            if self.keep is not None and (k >= self.keep or _is_done(event)):
                return  # the caller closes both sockets: the client sees the body end mid-way
            self._sleep_until(t + self.first_byte_delay)
            client.sendall(b"%x\r\n" % len(event) + event + b"\r\n")
            k += 1
        if self.keep is not None:
            return  # the stream ended before its cut: cut anyway, the terminator never goes
        client.sendall(b"0\r\n\r\n")

    @staticmethod
    def _read_events(ureader: _Reader, rpairs, events: queue.Queue) -> None:
        try:
            for event in sse_events(_body_pieces(ureader, rpairs)):
                events.put((time.monotonic(), event))
        except (OSError, ProtocolError, ValueError) as e:
            events.put((time.monotonic(), e))  # after a cut nobody reads it: harmless
        events.put(None)

    @staticmethod
    def _sleep_until(t: float) -> None:
        if (wait := t - time.monotonic()) > 0:
            time.sleep(wait)

    def close(self):
        # shutdown first: close() alone leaves the serving thread blocked in accept(), which
        # keeps the listening socket open and accepting (seen: a "closed" proxy still answered).
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already
        self.sock.close()

    def __enter__(self) -> "SSEProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
