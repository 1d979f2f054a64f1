"""Connections that would hold the server without asking it anything: a bound on how many are open, and a deadline
on receiving each request.

uvicorn closes a connection idle between two requests (timeout_keep_alive) and bounds the size of a request's
headers (h11_max_incomplete_event_size), but waits for ever for headers or a body sent a byte at a time: every byte
restarts its keep-alive clock. So each connection is uvicorn's own protocol inside a Watched one, which starts a
deadline when the connection opens and when each response ends (its next request's headers must arrive within
`header_seconds`), moves it when the request reaches the application (its body must then arrive within
`body_seconds`), and stops it once the body is in: from then on the application decides (a request may wait for the
model as long as it likes). Past its deadline the connection is closed.

At `max_connections` open at once, or `max_per_address` from the client's address, a new connection first sheds
an idle one (`OpenConnections.make_room`): of the connections that count against the limit reached, the one that
has waited longest for its next request's headers (opened and silent, or between two requests) is closed. Only
when every one of them has a request under way (its body coming, or its answer) does the new one get a 503 and
close. Idle connections cost a client nothing to open, and on a loopback server every client has the same address:
64 idle sockets from 127.0.0.1 refused every local client for 10 s at a time, renewable. Shedding the oldest idle
one first leaves them no hold on the server, while a client that has just connected, and sends its request at
once, is the last to be shed.

The application learns which connection a request came on from the state uvicorn copies into each request's scope
(the `app_state` a protocol is made with): watch_requests is the middleware that tells the connection.
"""

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn import Config
from uvicorn.server import ServerState

_WATCH = "gali.connection"  # the key of a request's Watched connection in its scope's state


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may take to send a request, and how many connections may be open at once."""

    header_seconds: float = 10.0  # from the connection's start, or the last response's end, to a request's headers
    body_seconds: float = 60.0  # from the headers to the end of the body (32 MiB in a minute: about 0.5 MB/s)
    max_connections: int = 256
    max_per_address: int = 64  # from one client address (IP)


@dataclass
class OpenConnections:
    """The server's open connections, and how many come from each client address."""

    connections: set = field(default_factory=set)
    per_address: Counter = field(default_factory=Counter)

    def make_room(self, address: str, limits: ConnectionLimits) -> str | None:
        """Room for a new connection from `address` under both limits, made by closing the idle connection that has
        waited longest where one is at its limit (see the module's docstring); why it is refused where none can be
        closed (None: it is not)."""
        if len(self.connections) >= limits.max_connections and not self._shed(self.connections):
            return f"the server has {limits.max_connections} connections open, each with a request under way"
        if self.per_address[address] >= limits.max_per_address and not self._shed(
                [connection for connection in self.connections if connection.address == address]):
            return (f"{limits.max_per_address} connections from {address} are open, the limit for one address, each "
                    "with a request under way")
        return None

    def _shed(self, among) -> bool:
        """Close the connection of `among` idle the longest; whether there was one."""
        idle = [connection for connection in among if connection.idle_since is not None]
        if not idle:
            return False
        oldest = min(idle, key=lambda connection: connection.idle_since)
        self.discard(oldest)  # counted out now: its transport reports the loss later
        oldest.close()
        return True

    def add(self, connection: "Watched") -> None:
        self.connections.add(connection)
        self.per_address[connection.address] += 1

    def discard(self, connection: "Watched") -> None:
        if connection in self.connections:
            self.connections.remove(connection)
            self.per_address[connection.address] -= 1
            if not self.per_address[connection.address]:
                del self.per_address[connection.address]


class Watched(asyncio.Protocol):
    """One connection: uvicorn's HTTP protocol inside, under a deadline while a request is being received."""

    def __init__(self, limits: ConnectionLimits, open_connections: OpenConnections, protocol: type[asyncio.Protocol],
                 config: Config, server_state: ServerState, app_state: dict,
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Made by uvicorn for each connection (run.py binds `limits`, the server's set of open connections and the
        HTTP `protocol` class that reads the requests)."""
        self.limits, self.open = limits, open_connections
        self.inner = protocol(config=config, server_state=server_state, app_state={**app_state, _WATCH: self},
                              _loop=_loop)
        self.transport: asyncio.Transport | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.refused = False
        self.address = ""
        self.idle_since: float | None = None  # waiting for a request's headers since then (None: a request is on)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        refusal = self.open.make_room(self.address, self.limits)
        if refusal is not None:
            self.refused = True
            transport.write(_busy(refusal))
            transport.close()
            return
        self.open.add(self)
        self.inner.connection_made(transport)
        self.waiting(True)

    def waiting(self, idle: bool) -> None:
        """The connection waits for a request's headers (`idle`: under the header deadline, and sheddable), or has
        a request under way (its body's deadline, or none, is the caller's)."""
        self.idle_since = time.monotonic() if idle else None
        if idle:
            self.expect(self.limits.header_seconds)

    def close(self) -> None:
        """Close the connection (shed: see the module's docstring)."""
        self.expect(None)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.expect(None)
        if not self.refused:
            self.open.discard(self)
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.refused:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.refused else self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def expect(self, seconds: float | None) -> None:
        """Close the connection unless the next step of its request is done within `seconds` (None: no deadline)."""
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if seconds is not None and self.transport is not None and not self.transport.is_closing():
            self.deadline = asyncio.get_running_loop().call_later(seconds, self.transport.close)


def watch_requests(app: ASGIApp) -> ASGIApp:
    """`app`, telling each request's Watched connection when its headers have come (the body's deadline starts, if
    it has one), when its body is in (no more deadline) and when its response is done (the next request's starts)."""

    async def watched(scope: Scope, receive: Receive, send: Send) -> None:
        connection = scope.get("state", {}).get(_WATCH) if scope["type"] == "http" else None
        if connection is None:
            await app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        connection.waiting(False)
        connection.expect(connection.limits.body_seconds if has_body else None)

        async def receive_and_watch() -> Message:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                connection.expect(None)
            return message

        try:
            await app(scope, receive_and_watch, send)
        finally:
            connection.waiting(True)

    return watched


def _busy(refusal: str) -> bytes:
    """A whole HTTP response: 503, in OpenAI's error shape, and the connection closes."""
    body = json.dumps({"error": {"message": f"{refusal}; retry shortly",
                                 "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
