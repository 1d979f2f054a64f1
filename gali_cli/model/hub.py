"""Asking the Hugging Face hub only when it can answer. Offline, huggingface_hub retries a file for about 25 seconds,
printing a line a try, before it gives up; one short connection first says at once that the hub is out of reach."""

import socket
import urllib.request
from urllib.parse import urlsplit

from ..errors import ModelLoadError

CONNECT_SECONDS = 3.0  # the hub (or the proxy to it) answers a connection within this, or is taken for unreachable


def check_hub(repo: str, filename: str) -> None:
    """ModelLoadError at once when hub model `repo`'s `filename` must be fetched (it is not in the local hub cache)
    and the hub cannot be reached: its address (HF_ENDPOINT, or the proxy the environment names for it) does not
    resolve, or nothing accepts a connection within CONNECT_SECONDS. With HF_HUB_OFFLINE huggingface_hub answers
    from its cache alone, at once, so nothing is tried."""
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.is_offline_mode() or isinstance(try_to_load_from_cache(repo, filename), str):
        return
    endpoint = urlsplit(constants.ENDPOINT)
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    target = urlsplit(proxy if proxy and not urllib.request.proxy_bypass(endpoint.hostname or "") else
                      constants.ENDPOINT)
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        socket.create_connection((target.hostname or "", port), timeout=CONNECT_SECONDS).close()
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        raise ModelLoadError(f"cannot load model {repo!r}: it is not a local directory nor in the local hub cache, "
                             f"and the Hugging Face hub ({target.hostname}:{port}) cannot be reached ({reason}); "
                             "offline, give a model's folder or GGUF file") from None
