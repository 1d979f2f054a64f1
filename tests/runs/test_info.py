"""gali info (runs/info.py): -v says how a decoded token runs for the model and method, in the decision's words."""

import json

import pytest
import torch
from helpers.decoding import prefilled
from typer.testing import CliRunner

from gali_cli import cli
from gali_cli.engine.attention import decode_route
from gali_cli.engine.seam.static_decode import static_decoder
from gali_cli.loading import load_model


def info(*args: str, env: dict | None = None) -> str:
    result = CliRunner().invoke(cli.app, ["info", "-v", "-m", "demo", *args], env={"COLUMNS": "200", **(env or {})})
    assert result.exit_code == 0, result.stderr
    return result.stdout


def decoding_line(stdout: str) -> str:
    [line] = [line for line in stdout.splitlines() if line.startswith("decoding ")]
    return line.split(None, 1)[1]


@pytest.mark.parametrize("method, kernel, decode, expected", [
    ("original", "torch", "auto", "static step, PyTorch attention"),
    ("gali", "torch", "auto", f"eager ({decode_route.NOT_PAYING})"),
    ("gali", "auto", "eager", "eager (GALI_DECODE=eager)"),
    ("reattention", "auto", "auto", f"eager ({decode_route.no_static_step('reattention')})"),
    ("dynamic-ntk", "auto", "auto", f"eager ({decode_route.DYNAMIC_ROPE})"),
])
def test_info_v_says_how_decoding_runs(method, kernel, decode, expected):
    stdout = info("--method", method, env={"GALI_KERNEL": kernel, "GALI_DECODE": decode})
    assert decoding_line(stdout) == expected


def test_info_v_names_the_route_the_static_step_takes():
    """On the CPU in float32 the demo's heads (64 wide, 2 query heads a key head) fit the native kernel: GALI decodes
    by the static step there, wherever the kernel builds, and eagerly where it does not."""
    route = decode_route.attention_route(torch.device("cpu"), torch.float32, 64, 2)
    said = decoding_line(info("--method", "gali"))
    assert said == ("static step, native attention" if route == "native" else f"eager ({decode_route.NOT_PAYING})")


def test_the_words_are_the_decision_of_the_loaded_model(monkeypatch):
    """What gali info -v says without loading the model is what decoding does once it is loaded and prefilled."""
    monkeypatch.setenv("GALI_KERNEL", "torch")
    for method in ("original", "gali"):
        with torch.inference_mode():
            model, cache, _ = prefilled(lambda **_: load_model("demo", device="cpu", dtype="float32").model, method,
                                        40, 4)
            decoder = static_decoder(model, cache)
        said = decoding_line(info("--method", method, env={"GALI_KERNEL": "torch"}))
        assert said.startswith("eager (") == (decoder is None), (method, said)
        if decoder is not None:
            assert said == f"static step, {decode_route.ROUTE_WORDS[decoder.route]}"


def test_the_json_has_the_decoding_with_v_only():
    assert "decoding" in json.loads(info("--json"))
    plain = CliRunner().invoke(cli.app, ["info", "--json", "-m", "demo"])
    assert "decoding" not in json.loads(plain.stdout)
