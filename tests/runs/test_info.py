"""gali info (runs/info.py): -v says how a decoded token runs for the model and method, in the decision's words."""

import dataclasses
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


@pytest.mark.parametrize("methods", ["gali", "ntk", "gali,rerope", "rerope,ntk"])
def test_info_shows_the_settings_of_the_chosen_methods_alone(methods):
    """A method's settings row appears when it is chosen (from the window alone, or from the model's config): the
    registry says which, so `gali info --method ntk` shows no GALI settings."""
    facts = json.loads(info("--json", "--method", methods))
    shown = {name for name in ("gali", "ntk", "rerope") if name in facts}
    assert shown == set(methods.split(",")) - {"ntk"}
    if "gali" in shown:
        assert facts["gali"] == {"train_len": 256, "chunk_size": 64, "local_window": 128, "noise": False}


def test_a_16_bit_kv_cache_halves_the_kv_bytes_and_doubles_the_prompt_bound(monkeypatch):
    """gali info --kv-dtype float16 (a float32 model on the CPU): kv_mib_per_1k_tokens halved, the default
    --max-prompt-tokens doubled, as the commands bound a prompt with the model loaded (runs/common.prompt_limit)."""
    from gali_cli.runs.choices import Reading
    from gali_cli.runs.common import prompt_limit

    monkeypatch.setattr("gali_cli.runs.common.free_memory", lambda device: 2**34)
    monkeypatch.setattr("gali_cli.estimate.free_memory", lambda device: 2**34)
    facts = {kv: json.loads(info("--json", *(["--kv-dtype", kv] if kv else []))) for kv in (None, "model", "float16")}
    assert facts[None] == facts["model"] and facts[None]["kv_dtype"] == "float32"
    assert facts["float16"]["kv_dtype"] == "float16"
    assert facts["float16"]["kv_mib_per_1k_tokens"] == pytest.approx(facts[None]["kv_mib_per_1k_tokens"] / 2, abs=0.1)
    assert facts["float16"]["max_prompt_tokens"] == pytest.approx(2 * facts[None]["max_prompt_tokens"], rel=1e-3)
    loaded = load_model("demo", device="cpu")
    bounds = [prompt_limit(loaded, Reading()), prompt_limit(dataclasses.replace(loaded, kv_dtype=torch.float16),
                                                             Reading())]
    assert bounds[1] == pytest.approx(2 * bounds[0], rel=1e-3)
