"""A hub model on a machine that cannot reach the hub: one line at once, not half a minute of retries. Nothing here
reaches the network: the hub's address is one where nothing listens (127.0.0.1:9), or its name resolver fails."""

import socket
import time

import pytest
from helpers.timing import scaled
from huggingface_hub import constants

from gali_cli.cli import main
from gali_cli.model import hub


def _no_resolver(*args, **kwargs):
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


@pytest.mark.parametrize("endpoint, reason", [("http://127.0.0.1:9", "(127.0.0.1:9) cannot be reached (Connection "
                                                                     "refused)"),
                                              ("https://huggingface.co", "(huggingface.co:443) cannot be reached "
                                                                         "(Name or service not known)")])
def test_an_unreachable_hub_is_a_one_line_error_at_once(monkeypatch, capsys, endpoint, reason):
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    if "huggingface" in endpoint:
        monkeypatch.setattr(socket, "getaddrinfo", _no_resolver)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for variable in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(variable, raising=False)
    started = time.monotonic()
    assert main(["info", "-m", "some-org/some-model-xyz"]) == 4
    assert time.monotonic() - started < hub.CONNECT_SECONDS + scaled(5)
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "Retry" not in error
    assert "'some-org/some-model-xyz'" in error and "the Hugging Face hub" in error and reason in error


def test_offline_mode_asks_the_local_cache_only(monkeypatch, capsys):
    """HF_HUB_OFFLINE: no connection is tried; huggingface_hub says the file is not in the cache."""
    def no_connection(*args, **kwargs):
        raise AssertionError("a connection was tried offline")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(socket, "create_connection", no_connection)
    assert main(["info", "-m", "some-org/some-model-xyz"]) == 4
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "some-org/some-model-xyz" in error and "AssertionError" not in error
