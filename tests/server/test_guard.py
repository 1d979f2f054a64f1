"""Who may reach gali serve: Host names, web origins, JSON bodies (guard.py). End-to-end cases, through a real server
and the raw HTTP a browser sends, are in tests/server/test_server.py."""

import socket

import pytest
from typer.testing import CliRunner

import gali_cli.cli as cli
import gali_cli.runs.serve as serve_run
from gali_cli.server.guard import LOCAL_NAMES, Reach

LOCAL = Reach.for_bind("127.0.0.1")
WIDE = Reach.for_bind("0.0.0.0")


@pytest.mark.parametrize("host, local, wide", [
    ("localhost:8000", True, True),
    ("127.0.0.1:8000", True, True),
    ("[::1]:8000", True, True),
    ("LocalHost:8000", True, True),  # names are case-insensitive
    (None, True, True),  # HTTP/1.0 sends no Host: no browser does that
    ("localhost:8001", False, False),  # another port: another server's page
    ("localhost", False, False),  # port 80
    ("evil.example:8000", False, False),  # a DNS-rebinding page sends its own name
    ("localhost.evil.example:8000", False, False),
    ("192.168.1.7:8000", False, True),  # by its address: the page's origin is the server's own
    ("[fe80::1]:8000", False, True),
    ("192.168.1.7:9", False, False),
    ("localhost:80x", False, False),
    ("localhost:", False, False),
    ("", False, False),
])
def test_the_host_names_a_server_answers_to(host, local, wide):
    assert LOCAL.allows_host(host, 8000) is local
    assert WIDE.allows_host(host, 8000) is wide


def test_a_loopback_bind_answers_to_the_local_names_only_and_a_wide_one_also_to_its_host_name():
    assert Reach.for_bind("::1").names == LOCAL_NAMES == Reach.for_bind("127.0.0.2").names
    assert not Reach.for_bind("::1").addresses
    hostname = socket.gethostname().lower()
    assert WIDE.allows_host(f"{hostname}:8000", 8000) and WIDE.addresses
    assert Reach.for_bind("10.1.2.3").addresses and Reach.for_bind("::").addresses


def test_allow_host_adds_names_at_any_port_and_star_any_host():
    reach = Reach.for_bind("127.0.0.1", ("Gali.Example",))
    assert reach.allows_host("gali.example", 8000) and reach.allows_host("GALI.example:443", 8000)
    assert not reach.allows_host("other.example:8000", 8000)
    assert Reach.for_bind("127.0.0.1", ("*",)).allows_host("anything.example:1", 8000)


def test_allow_origin_lets_in_exactly_the_origins_named():
    assert not LOCAL.allows_origin("http://localhost:3000")  # CORS is off unless asked for
    reach = Reach.for_bind("127.0.0.1", (), ("http://localhost:3000/",))
    assert reach.allows_origin("http://localhost:3000") and reach.allows_origin("HTTP://LOCALHOST:3000")
    assert not reach.allows_origin("http://localhost:3001") and not reach.allows_origin("null")
    assert Reach.for_bind("127.0.0.1", (), ("*",)).allows_origin("https://anywhere.example")


def test_gali_serve_builds_its_reach_from_the_bound_address_and_the_options(tiny_model_dir, monkeypatch):
    served = []
    monkeypatch.setattr(serve_run, "run_server", lambda worker, settings, listener, log: served.append(settings))
    result = CliRunner().invoke(cli.app, ["serve", "-m", str(tiny_model_dir), "--port", "0", "--allow-host", "a.lan",
                                          "--allow-host", "b.lan", "--allow-origin", "http://localhost:3000"])
    assert result.exit_code == 0, result.stderr
    assert served[0].reach == Reach(LOCAL_NAMES, frozenset({"a.lan", "b.lan"}), False,
                                    frozenset({"http://localhost:3000"}))


@pytest.mark.parametrize("origin", ["evil", "localhost:3000", "http://x/path", ""])
def test_a_bad_allow_origin_is_a_usage_error_before_anything_loads(origin, capsys):
    assert cli.main(["serve", "-m", "/nonexistent", "--allow-origin", origin]) == 2
    error = capsys.readouterr().err
    assert "--allow-origin" in error and "web origin" in error and len(error.splitlines()) == 1


def test_any_origin_without_an_api_key_is_warned_about(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(serve_run, "run_server", lambda worker, settings, listener, log: None)
    arguments = ["serve", "-m", str(tiny_model_dir), "--port", "0", "--allow-origin", "*"]
    warned = CliRunner().invoke(cli.app, arguments, env={"COLUMNS": "200"})
    assert warned.exit_code == 0 and "any web page you visit can use the model" in warned.stderr
    keyed = CliRunner().invoke(cli.app, [*arguments, "--api-key", "k"], env={"COLUMNS": "200"})
    assert keyed.exit_code == 0 and "warning" not in keyed.stderr


@pytest.mark.parametrize("key", ["", " sekret", "sekret\n", "clé", "a\x00b"])
def test_an_api_key_no_client_could_send_is_refused_at_start(key, tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(serve_run, "load", lambda choice: pytest.fail("loaded a model for a bad key"))
    assert cli.main(["serve", "-m", str(tiny_model_dir), "--port", "0", "--api-key", key]) == 2
    error = capsys.readouterr().err
    assert "--api-key" in error and len(error.strip().splitlines()) == 1
    assert ("GALI_API_KEY=''" in error) == (key == "")


def test_a_bad_gali_api_key_is_named_as_the_variable(tiny_model_dir, monkeypatch, capsys):
    """A key from GALI_API_KEY that no client could send was reported as --api-key, which the user never gave."""
    monkeypatch.setattr(serve_run, "load", lambda choice: pytest.fail("loaded a model for a bad key"))
    monkeypatch.setenv("GALI_API_KEY", " sekret")
    assert cli.main(["serve", "-m", str(tiny_model_dir), "--port", "0"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("gali: GALI_API_KEY: a key must be printable ASCII") and "--api-key" not in error


def test_an_empty_gali_api_key_means_no_key(tiny_model_dir, monkeypatch):
    served = []
    monkeypatch.setattr(serve_run, "run_server", lambda worker, settings, listener, log: served.append(settings))
    result = CliRunner().invoke(cli.app, ["serve", "-m", str(tiny_model_dir), "--port", "0"],
                                env={"GALI_API_KEY": ""})
    assert result.exit_code == 0, result.stderr
    assert served[0].api_key is None


def test_max_prompt_tokens_defaults_to_what_the_machine_holds_and_reads(tiny_model_dir, monkeypatch):
    served = []
    monkeypatch.setattr(serve_run, "run_server", lambda worker, settings, listener, log: served.append(settings))
    monkeypatch.setattr(serve_run, "free_memory", lambda device: 2**30)
    arguments = ["serve", "-m", str(tiny_model_dir), "--port", "0"]
    assert CliRunner().invoke(cli.app, arguments).exit_code == 0
    assert CliRunner().invoke(cli.app, [*arguments, "--max-prompt-tokens", "1234"]).exit_code == 0
    assert served[0].max_prompt_tokens > 1000 and served[1].max_prompt_tokens == 1234
