import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from gali_cli.errors import ConfigError, ModelLoadError, UnsupportedModelError
from gali_cli.loading import demo_model_path, load_config, load_model, model_source, resolve_device, resolve_dtype


def test_model_sources(tmp_path):
    assert model_source("demo") == str(demo_model_path())
    assert model_source(str(tmp_path)) == str(tmp_path)
    assert model_source("meta-llama/Meta-Llama-3-8B-Instruct") == "meta-llama/Meta-Llama-3-8B-Instruct"
    for path in ["./missing-model", "/no/such/dir", "~/nothing-here-either"]:
        with pytest.raises(ModelLoadError, match="no such directory"):
            model_source(path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a file"):
        model_source(str(tmp_path / "weights.bin"))


def test_non_llama_models_are_refused_before_loading_weights(tmp_path):
    MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'mistral' model"):
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
