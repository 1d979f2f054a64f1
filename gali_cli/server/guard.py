"""Which requests reach the application at all: only the user's own programs, never a web page they visit.

A page in the user's browser can send requests to 127.0.0.1, and after a DNS rebinding (its own name re-pointed at
127.0.0.1) read the answers too. Local model servers closed this after such reports (ollama checks Host and
Origin, OLLAMA_ORIGINS widening the origins); gali does the same, in one ASGI middleware before any route:

- **Host**: the Host header must name this server as its own programs do: localhost, 127.0.0.1 or [::1] with the
  port it listens on. A rebinding page sends its own name, so it is refused. Bound to another address (0.0.0.0, a
  LAN address), any IP address and the machine's host name are also accepted (a browser that reaches the server
  by its address is no rebinding: the page's origin is the server's); other names (a proxy's, a DNS name) need
  `--allow-host NAME`, and `--allow-host '*'` accepts any.
- **Origin**: browsers name the page's origin on every cross-origin request; programs send none. A request with an
  Origin not given by `--allow-origin` is refused, so CORS is off unless asked for; for an allowed origin, the
  preflight (OPTIONS) is answered and the response carries Access-Control-Allow-Origin.
- **Header size**: a request line and headers of more than MAX_HEADER_BYTES are a 431, whether they arrive in pieces
  (uvicorn's h11 stops buffering there) or in one (h11 parses them whole: counted here).
- **Content-Type**: a POST must be JSON. A page may send a cross-origin POST without asking (a "simple" request)
  only as text/plain or a form; JSON needs the preflight the Origin rule refuses.

Refusals are OpenAI-style JSON errors (403, 415, 431) with the reason noted for the access log. `JsonErrors` makes
uvicorn's own 400 (a request that is not valid HTTP, such as a malformed Content-Length) JSON too.
"""

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

import h11
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from .schemas import APIError

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
ANY = "*"
PREFLIGHT_SECONDS = 600  # how long a browser may remember an allowed preflight
MAX_HEADER_BYTES = 16 * 2**10  # a request line and headers; also uvicorn's h11_max_incomplete_event_size default
# After a 400 or 431, how long and how much of the rest of the request is read and dropped before the connection
# closes (a lingering close, as web servers do): closing with unread bytes resets it, and a reset that overtakes the
# error discards it before the client reads it.
LINGER_SECONDS, LINGER_BYTES = 5.0, 2**20


@dataclass(frozen=True)
class Reach:
    """Who may reach the server: the Host names it answers to and the web origins it lets in (CORS).

    `names` are accepted with the server's port (the one the connection came in on); `extra_hosts` (--allow-host)
    with any port, ANY for every host; `addresses`: any IP address too (a non-loopback bind); `origins`
    (--allow-origin, ANY for every origin) are the only ones whose requests are served."""

    names: frozenset[str] = LOCAL_NAMES
    extra_hosts: frozenset[str] = frozenset()
    addresses: bool = False
    origins: frozenset[str] = frozenset()

    @classmethod
    def for_bind(cls, address: str, allow_hosts: tuple[str, ...] = (),
                 allow_origins: tuple[str, ...] = ()) -> "Reach":
        """The reach of a server listening on `address` (an IP address, as the bound socket says), widened by
        --allow-host and --allow-origin."""
        loopback = ipaddress.ip_address(address.split("%")[0]).is_loopback
        names = LOCAL_NAMES if loopback else LOCAL_NAMES | {socket.gethostname().lower()}
        return cls(names, frozenset(host.lower() for host in allow_hosts), not loopback,
                   frozenset(origin.lower().rstrip("/") for origin in allow_origins))

    def allows_host(self, host: str | None, port: int) -> bool:
        """Whether a request with this Host header, on a connection to `port`, comes from the user's programs. No
        Host header (HTTP/1.0) is no browser's."""
        if host is None or ANY in self.extra_hosts:
            return True
        name, given_port = _split_host(host.lower())
        if name is None:
            return False
        if name in self.extra_hosts:
            return True
        if given_port != port:
            return False
        return name in self.names or (self.addresses and _is_address(name))

    def allows_origin(self, origin: str) -> bool:
        return ANY in self.origins or origin.lower().rstrip("/") in self.origins


class Guard:
    """ASGI middleware that refuses what `reach` does not allow before any route sees it (see the module's
    docstring), and answers allowed CORS preflights."""

    def __init__(self, app: ASGIApp, reach: Reach) -> None:
        self.app, self.reach = app, reach

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if _header_bytes(scope) > MAX_HEADER_BYTES:
            await _error(_headers_too_large(), scope, receive, send)
            return
        host, origin = headers.get("host"), headers.get("origin")
        port = (scope.get("server") or ("", 80))[1]
        if not self.reach.allows_host(host, port):
            error = APIError(403, f"the Host header {host!r} is not this server's: a web page's request is refused "
                                  "(gali serve --allow-host NAME accepts another name)", "permission_denied_error",
                             code="host_not_allowed")
        elif origin is not None and not self.reach.allows_origin(origin):
            error = APIError(403, f"requests from the web origin {origin!r} are refused (gali serve --allow-origin "
                                  "ORIGIN lets a web page use the server)", "permission_denied_error",
                             code="origin_not_allowed")
        elif origin is not None and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _preflight(origin, headers)(scope, receive, send)
            return
        elif scope["method"] == "POST" and not _is_json(headers.get("content-type")):
            error = APIError(415, f"the body must be JSON: Content-Type: application/json, not "
                                  f"{headers.get('content-type', 'none')!r}", code="unsupported_media_type")
        else:
            await self.app(scope, receive, _allowing(origin, send) if origin is not None else send)
            return
        await _error(error, scope, receive, send)


async def _error(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    scope.setdefault("state", {})["note"] = error.message  # for the access log
    await JSONResponse(error.body(), error.status, headers=error.headers)(scope, receive, send)


def _headers_too_large() -> APIError:
    return APIError(431, f"the request line and headers are larger than the server's limit of {MAX_HEADER_BYTES} "
                         "bytes", code="headers_too_large")


def _header_bytes(scope: Scope) -> int:
    """The size of a request's line and headers as sent (give or take the HTTP version's few bytes)."""
    line = len(scope["method"]) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 12
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


def _preflight(origin: str, headers: Headers) -> Response:
    """The answer to an allowed origin's preflight: the methods the API has and the headers the page asked for."""
    return Response(status_code=204, headers={
        "Access-Control-Allow-Origin": origin, "Vary": "Origin", "Access-Control-Allow-Methods": "GET, POST",
        "Access-Control-Allow-Headers": headers.get("access-control-request-headers", ""),
        "Access-Control-Max-Age": str(PREFLIGHT_SECONDS)})


def _allowing(origin: str, send: Send) -> Send:
    """`send` with the CORS header that lets the page at `origin` read the response."""

    async def send_allowed(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []),
                                              (b"access-control-allow-origin", origin.encode("latin-1")),
                                              (b"vary", b"Origin")]}
        await send(message)

    return send_allowed


def _split_host(host: str) -> tuple[str | None, int]:
    """(name, port) of a Host header ("[::1]:8000", "localhost": port 80 when it names none); (None, 0) when it
    is not one."""
    if host.endswith("]") or ":" not in host:
        return host, 80
    name, _, port = host.rpartition(":")
    return (name, int(port)) if port.isascii() and port.isdigit() else (None, 0)


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


def _is_json(content_type: str | None) -> bool:
    return content_type is not None and content_type.partition(";")[0].strip().lower() == "application/json"


class JsonErrors(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, whose 400 for a request that is not valid HTTP (a malformed Content-Length or
    header line, which never reaches the application) is OpenAI-style JSON instead of plain text, and reaches a
    client that is still sending: the server stops writing, then reads and drops the rest of the request (at most
    LINGER_BYTES, for at most LINGER_SECONDS, or until the client closes) before it closes the connection."""

    _dropped: int | None = None  # bytes dropped since the error was sent (None: no error sent)
    _linger: asyncio.TimerHandle | None = None  # the close at LINGER_SECONDS

    def send_400_response(self, msg: str) -> None:
        if len(self.conn.trailing_data[0]) > MAX_HEADER_BYTES:  # h11 stopped buffering headers that long
            error = _headers_too_large()
        else:
            error = APIError(400, "the request is not valid HTTP/1.1 (a malformed request line or header, such as "
                                  "Content-Length)", code="invalid_http")
        body = JSONResponse(error.body()).body
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        reason = b"Request Header Fields Too Large" if error.status == 431 else b"Bad Request"
        for event in (h11.Response(status_code=error.status, reason=reason, headers=headers), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._dropped = 0
        self._linger = self.loop.call_later(LINGER_SECONDS, self.transport.close)
        if self.cycle is not None and not self.cycle.response_complete:  # an error inside a request's body
            self.cycle.disconnected = True  # its handler reads a disconnect, and what it sends goes nowhere
            self.cycle.message_event.set()
        self.flow.resume_reading()  # a read paused for a full buffer would never see the client's bytes or its end

    def shutdown(self) -> None:
        if self._dropped is not None:  # the answer is sent: nothing is left to wait for
            self.transport.close()
            return
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._dropped is None:
            super().data_received(data)
            return
        self._dropped += len(data)
        if self._dropped > LINGER_BYTES:
            self.transport.close()

    def eof_received(self) -> bool | None:
        if self._dropped is not None:  # the client has sent all it will: nothing is left to reset the answer
            self.transport.close()
        return super().eof_received()
