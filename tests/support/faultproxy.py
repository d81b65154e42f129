"""A small threaded HTTP/1.1 proxy on 127.0.0.1 that injects faults between a client and a server.

Fault kinds, chosen per request by a seeded probability or an explicit schedule:

``reset``     forward the request, send the response head and half the body, then RST the socket
``truncate``  same, but close normally (a body shorter than its Content-Length)
``flip``      flip one byte in the middle of the response body
``slowdown``  answer 503 SlowDown without forwarding
``error500``  answer 500 InternalError without forwarding
``latency``   wait ``fault_latency_s`` before answering
``hold``      read the whole request, then hold it until ``release()`` before forwarding it (the
              client times out and gives up; the request lands later, as a slow network can make
              it); the answer goes to a client that is gone

``latency_s`` adds a fixed delay to every request (half before forwarding it, half before the
answer): request/response round trips then take that much longer, as over a WAN.
Traffic is counted whatever the faults: ``requests`` (and ``requests_by_method``), ``bytes_up``
(request heads and bodies read from clients) and ``bytes_down`` (response heads and bodies sent
to them); ``reset_traffic()`` zeroes them (``counts`` of faults are kept).
``strip_request_headers`` drops headers before forwarding (to imitate a server that ignores them;
only works with servers that do not check signatures, such as moto).

Only as much HTTP is parsed as needed: the request and response heads, Content-Length and chunked
bodies, ``Expect: 100-continue`` (answered by the proxy itself), keep-alive.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable

KINDS = ("reset", "truncate", "flip", "slowdown", "error500", "latency")
HOLD = "hold"  # only by schedule: not a random fault
_CHUNK = 64 * 1024
_CANNED = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "error500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
}


class _Closed(Exception):
    pass


def _read_head(f) -> tuple[bytes, list[tuple[str, str]]]:
    first = f.readline(65537)
    if not first:
        raise _Closed
    headers = []
    while True:
        line = f.readline(65537)
        if not line:
            raise _Closed
        if line in (b"\r\n", b"\n"):
            return first, headers
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))


def _get(headers, name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _head_bytes(first: bytes, headers) -> bytes:
    return first + b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers) + b"\r\n"


def _body_chunks(f, headers, *, none: bool = False):
    """Yield a message body in pieces (de-chunked); without a length there is no body."""
    if none:
        return
    if (_get(headers, "transfer-encoding") or "").lower() == "chunked":
        while True:
            size = int(f.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while f.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return
            yield f.read(size)
            f.readline()
    remaining = int(_get(headers, "content-length") or 0)
    while remaining > 0:
        piece = f.read(min(_CHUNK, remaining))
        if not piece:
            raise _Closed
        remaining -= len(piece)
        yield piece


class FaultProxy:
    """``with FaultProxy(("127.0.0.1", 8333), probability=0.2, seed=1) as proxy:`` then point the
    client at ``proxy.endpoint``; ``proxy.counts`` holds injected faults by kind."""

    def __init__(self, upstream: tuple[str, int], *, probability: float = 0.0,
                 kinds: tuple[str, ...] = KINDS, seed: int = 0,
                 schedule: Callable[[int, str, str], str | None] | None = None,
                 methods: tuple[str, ...] | None = None, latency_s: float = 0.0,
                 fault_latency_s: float = 0.3, strip_request_headers: tuple[str, ...] = (),
                 listen: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        assert all(k in KINDS for k in kinds), kinds
        self._released = threading.Event()
        self.held = 0
        self.landed_after_hold = 0
        self.upstream = upstream
        self.probability, self.kinds, self.methods = probability, kinds, methods
        self.schedule = schedule
        self.latency_s, self.fault_latency_s = latency_s, fault_latency_s
        self.strip = {h.lower() for h in strip_request_headers}
        self.counts: Counter[str] = Counter()
        self.requests = 0
        self.requests_by_method: Counter[str] = Counter()
        self.bytes_up = 0
        self.bytes_down = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._sock = socket.create_server(listen)
        self._conns: set[socket.socket] = set()
        self._stopped = False
        host, port = self._sock.getsockname()[:2]
        self.endpoint = f"http://{host}:{port}"

    def set_faults(self, *, probability: float | None = None, kinds: tuple[str, ...] | None = None,
                   methods: tuple[str, ...] | None = None) -> None:
        with self._lock:
            if probability is not None:
                self.probability = probability
            if kinds is not None:
                self.kinds = kinds
            self.methods = methods

    def reset_traffic(self) -> None:
        """Zero the traffic counters (requests, by method, bytes up and down)."""
        with self._lock:
            self.requests_by_method.clear()
            self.bytes_up = self.bytes_down = 0

    def traffic(self) -> tuple[int, int, int]:
        """(requests, bytes up, bytes down) since the last ``reset_traffic()``."""
        with self._lock:
            return sum(self.requests_by_method.values()), self.bytes_up, self.bytes_down

    def _up(self, n: int) -> None:
        with self._lock:
            self.bytes_up += n

    def _down(self, n: int) -> None:
        with self._lock:
            self.bytes_down += n

    def release(self) -> None:
        """Forward every held request (and every later one that would be held)."""
        self._released.set()

    # --- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> "FaultProxy":
        threading.Thread(target=self._accept, daemon=True, name="faultproxy").start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped = True
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _choose(self, method: str, path: str) -> str | None:
        with self._lock:
            index = self.requests
            self.requests += 1
            self.requests_by_method[method] += 1
            if self.schedule is not None:
                kind = self.schedule(index, method, path)
            elif self.methods is not None and method not in self.methods:
                kind = None
            elif self.probability and self._rng.random() < self.probability:
                kind = self._rng.choice(self.kinds)
            else:
                kind = None
        return kind

    def _count(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    # --- one client connection ----------------------------------------------------------------
    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle/delayed-ACK stalls
        with self._lock:
            self._conns.add(client)
        cf = client.makefile("rb")
        uf = None
        try:
            while True:
                first, headers = _read_head(cf)
                method, path = first.decode("latin-1").split(" ")[:2]
                self._up(len(_head_bytes(first, headers)))
                kind = self._choose(method, path)
                if _get(headers, "expect"):
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                headers = [(k, v) for k, v in headers
                           if k.lower() != "expect" and k.lower() not in self.strip]
                if kind in _CANNED:  # answer ourselves; the request never reaches the server
                    for piece in _body_chunks(cf, headers):
                        self._up(len(piece))
                    self._count(kind)
                    status, reason, code, message = _CANNED[kind]
                    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                            f"<Message>{message}</Message></Error>").encode()
                    canned = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml"
                              f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
                    client.sendall(canned)
                    self._down(len(canned))
                    continue
                if self.latency_s:
                    time.sleep(self.latency_s / 2)
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    uf = upstream.makefile("rb")
                    with self._lock:
                        self._conns.add(upstream)
                chunked = (_get(headers, "transfer-encoding") or "").lower() == "chunked"
                if kind == HOLD:  # the whole request first, then wait for release()
                    body = list(_body_chunks(cf, headers))
                    with self._lock:
                        self.held += 1
                    self._released.wait()
                upstream.sendall(_head_bytes(first, headers))
                for piece in (body if kind == HOLD else _body_chunks(cf, headers)):
                    self._up(len(piece))
                    upstream.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                if chunked:
                    upstream.sendall(b"0\r\n\r\n")
                rfirst, rheaders = _read_head(uf)
                while rfirst.split(b" ")[1].startswith(b"1"):  # 100 Continue from upstream
                    rfirst, rheaders = _read_head(uf)
                status = int(rfirst.split(b" ")[1])
                if kind == HOLD:
                    with self._lock:
                        self.landed_after_hold += status < 300
                no_body = method == "HEAD" or status in (204, 304)
                if kind == "latency":
                    self._count(kind)
                    time.sleep(self.fault_latency_s)
                if self.latency_s:
                    time.sleep(self.latency_s / 2)
                if not self._relay(client, uf, rfirst, rheaders, no_body, kind):
                    return
                if (_get(rheaders, "connection") or "").lower() == "close":
                    upstream.close()
                    upstream = None
        except (_Closed, OSError, ValueError, IndexError):
            pass
        finally:
            for s in (client, upstream):
                if s is not None:
                    with self._lock:
                        self._conns.discard(s)
                    s.close()

    def _relay(self, client, uf, rfirst, rheaders, no_body: bool, kind: str | None) -> bool:
        """Send the response to the client, injecting ``kind``; False if the connection is done."""
        if (_get(rheaders, "transfer-encoding") or "").lower() == "chunked":
            body = b"".join(_body_chunks(uf, rheaders))  # small (XML); re-send with a length
            rheaders = [(k, v) for k, v in rheaders if k.lower() != "transfer-encoding"]
            rheaders.append(("Content-Length", str(len(body))))
            pieces = iter([body])
        else:
            pieces = _body_chunks(uf, rheaders, none=no_body)
        length = 0 if no_body else int(_get(rheaders, "content-length") or 0)
        head = _head_bytes(rfirst, rheaders)
        if kind in ("reset", "truncate"):
            self._count(kind)
            cut = length // 2
            if length == 0:
                client.sendall(head[: len(head) // 2])
                self._down(len(head) // 2)
            else:
                client.sendall(head)
                self._down(len(head))
                sent = 0
                for piece in pieces:
                    take = piece[: max(0, cut - sent)]
                    if take:
                        client.sendall(take)
                        self._down(len(take))
                    sent += len(piece)
                    if sent >= cut:
                        break
            if kind == "reset":
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        client.sendall(head)
        self._down(len(head))
        flip_at = length // 2 if kind == "flip" and length > 0 else -1
        if flip_at >= 0:
            self._count(kind)
        sent = 0
        for piece in pieces:
            if 0 <= flip_at - sent < len(piece):
                i = flip_at - sent
                piece = piece[:i] + bytes([piece[i] ^ 0xFF]) + piece[i + 1:]
            client.sendall(piece)
            self._down(len(piece))
            sent += len(piece)
        return True
