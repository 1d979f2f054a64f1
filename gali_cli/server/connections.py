"""Connections that would hold the server without asking it anything: a bound on how many are open, and a deadline
on receiving each request.

uvicorn closes a connection idle between two requests (timeout_keep_alive) and bounds the size of a request's
headers (h11_max_incomplete_event_size), but waits for ever for headers or a body sent a byte at a time: every byte
restarts its keep-alive clock. So each connection is uvicorn's own protocol inside a Watched one, which starts a
deadline when the connection opens and when each response ends (its next request's headers must arrive within
`header_seconds`), moves it when the request reaches the application (its body must then arrive within
`body_seconds`), and stops it once the body is in: from then on the application decides (a request may wait for the
model as long as it likes). Past its deadline the connection is closed. Past `max_connections` open at once, or
`max_per_address` from the client's address, a new one gets a 503 and is closed: one client holding many idle
connections fills its own share, not everyone's.

The application learns which connection a request came on from the state uvicorn copies into each request's scope
(the `app_state` a protocol is made with): watch_requests is the middleware that tells the connection.
"""

import asyncio
import json
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

    def refusal(self, address: str, limits: ConnectionLimits) -> str | None:
        """Why a new connection from `address` is refused (None: it is not)."""
        if len(self.connections) >= limits.max_connections:
            return f"the server has {limits.max_connections} connections open, its limit"
        if self.per_address[address] >= limits.max_per_address:
            return f"{limits.max_per_address} connections from {address} are open, the limit for one address"
        return None

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

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        refusal = self.open.refusal(self.address, self.limits)
        if refusal is not None:
            self.refused = True
            transport.write(_busy(refusal))
            transport.close()
            return
        self.open.add(self)
        self.inner.connection_made(transport)
        self.expect(self.limits.header_seconds)

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
        connection.expect(connection.limits.body_seconds if has_body else None)

        async def receive_and_watch() -> Message:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                connection.expect(None)
            return message

        try:
            await app(scope, receive_and_watch, send)
        finally:
            connection.expect(connection.limits.header_seconds)

    return watched


def _busy(refusal: str) -> bytes:
    """A whole HTTP response: 503, in OpenAI's error shape, and the connection closes."""
    body = json.dumps({"error": {"message": f"{refusal}; retry shortly",
                                 "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
