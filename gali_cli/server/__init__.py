"""`gali serve`: an OpenAI-compatible HTTP server that reads prompts longer than the model's window.

- `schemas`: what clients send (pydantic, strict) and get back (OpenAI's JSON shapes), and OpenAI-style errors.
- `worker`: the one thread that owns the model; requests queue for it and stream their text back.
- `reuse`: which prefilled state a request can start from (the last request's, or the document cache's).
- `guard`: who may reach it: Host names, web origins (CORS), JSON bodies; uvicorn's own 400 as JSON.
- `app`: the ASGI application (Starlette): routes, API key, body limit, server-sent events, access log.
- `run`: binding the port, uvicorn, and stopping cleanly on SIGTERM or Ctrl-C.

`schemas`, `guard`, `app` and `run` need the `serve` extra (pydantic, starlette, uvicorn); `require_extra` says how to
install it.
"""

from ..errors import ConfigError
from ..extras import install_hint

EXTRA_HINT = f"gali serve needs the server extra: {install_hint('serve')}"


def require_extra() -> None:
    """Raise ConfigError (exit 2, one line) when the server's dependencies are not installed."""
    try:
        import pydantic  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise ConfigError(f"{EXTRA_HINT} ({error.name} is missing)") from error
