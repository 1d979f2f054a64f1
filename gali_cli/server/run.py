"""Running the server: the port is taken before the model loads (a busy port fails at once, not after a minute of
loading), uvicorn serves the application on it, and SIGTERM or Ctrl-C stop it cleanly: no new connections, the
requests in flight ended (a 503, or an error event on a stream), the worker's last forward and any document-cache
write finished, then the process ends as the signal says (143 for SIGTERM, 130 for Ctrl-C). Each connection is
watched (connections.py): how many are open, and how long a client takes to send a request, are bounded."""

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Iterator
from functools import partial

import uvicorn

from ..errors import ConfigError, GaliError
from .app import ServerSettings, create_app
from .connections import OpenConnections, Watched, watch_requests
from .guard import JsonErrors
from .worker import ModelWorker

GRACEFUL_SECONDS = 30  # at most this long for clients to take their last bytes once the server stops


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (port 0: any free port); a bad host is a ConfigError, a busy port a
    GaliError."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise ConfigError(f"--host {host}: {getattr(error, 'strerror', None) or error}") from None
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(2048)
    except OSError as error:
        listener.close()
        raise GaliError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    listener.set_inheritable(True)
    return listener


def address(listener: socket.socket) -> str:
    """The base URL clients use, e.g. http://127.0.0.1:8000."""
    host, port = listener.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(worker: ModelWorker, settings: ServerSettings, listener: socket.socket, log: Callable[[str], None]) -> None:
    """Serve until SIGTERM or Ctrl-C (then the signal's own exit follows: uvicorn raises it again once stopped)."""
    worker.start()
    try:
        Server(worker, settings, log).run(sockets=[listener])
    finally:
        worker.stop()


class Server(uvicorn.Server):
    """uvicorn's server, which also stops the model worker: at the signal, so that requests in flight end at once
    instead of holding the shutdown, and at the end, waiting for the worker's last forward."""

    def __init__(self, worker: ModelWorker, settings: ServerSettings, log: Callable[[str], None]) -> None:
        self.connections = OpenConnections()
        super().__init__(uvicorn.Config(watch_requests(create_app(worker, settings, log)), log_config=None,
                                        log_level="warning", access_log=False, lifespan="off", ws="none",
                                        http=partial(Watched, settings.connections, self.connections, JsonErrors),
                                        timeout_graceful_shutdown=GRACEFUL_SECONDS))
        self.worker, self.log = worker, log

    def handle_exit(self, sig: int, frame) -> None:
        if not self.worker.stopping:
            self.log("stopping: ending the requests in flight")
        self.worker.stop()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, and then the process still ends as the signal it stopped on says (130 for SIGINT, 143 for
        SIGTERM) where that signal was ignored when it started: uvicorn restores the handler it found and raises the
        signal again, which SIG_IGN drops. `gali serve &` from a shell without job control starts with SIGINT
        ignored, and exited 0 after a SIGINT stopped it."""
        ignored = {sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is signal.SIG_IGN}
        with super().capture_signals():
            yield
        stopped_by = [sig for sig in getattr(self, "_captured_signals", []) if sig in ignored]
        if signal.SIGINT in stopped_by:
            raise KeyboardInterrupt  # the command line's Ctrl-C: "interrupted", exit 130
        if stopped_by:
            raise SystemExit(128 + signal.SIGTERM)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.worker.stop()
        await super().shutdown(sockets)
        while not self.force_exit and not self.worker.join(timeout=0):
            await asyncio.sleep(0.05)  # the worker finishes its forward (a second Ctrl-C does not wait)
        self.log("stopped")
