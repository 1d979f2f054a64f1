"""model/config.py reads a Llama's config.json without transformers: it must read it as transformers does."""

import json
import re

import pytest
from transformers import AutoConfig, LlamaConfig, Phi3Config

from gali_cli.errors import ModelLoadError, UnsupportedModelError
from gali_cli.model.config import demo_model_path, read_model_config

LLAMA = {"family": "Llama", "methods": "yes"}  # gali's own table (model/families.py)


def transformers_facts(directory) -> dict:
    """What `gali info` showed when it read the config with transformers."""
    config = AutoConfig.from_pretrained(directory)
    return {"architecture": (config.architectures or ["LlamaForCausalLM"])[0], "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size, "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "vocab_size": config.vocab_size,
            "train_len": config.max_position_embeddings, "rope": dict(config.rope_parameters or {}), **LLAMA}


LLAMA_3_1_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"}


@pytest.mark.parametrize("config", [
    {"rope_theta": 500000.0, "rope_scaling": LLAMA_3_1_ROPE, "max_position_embeddings": 131072},  # Llama 3.1
    {"rope_theta": 500000.0, "max_position_embeddings": 8192, "num_key_value_heads": 8},  # Llama 3, old style
    {"rope_scaling": {"type": "linear", "factor": 2.0}, "max_position_embeddings": 4096},  # Llama 2, "type"
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings": 2048},
    {},  # LlamaConfig's defaults throughout
], ids=["llama-3.1", "llama-3", "linear", "yarn", "defaults"])
def test_config_json_reads_as_transformers_reads_it(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    assert read_model_config(str(tmp_path)).facts() == transformers_facts(tmp_path)


def test_configs_transformers_wrote(tmp_path, tiny_model_dir):
    LlamaConfig(num_hidden_layers=2, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **LLAMA_3_1_ROPE}
                ).save_pretrained(tmp_path)
    for directory in (tmp_path, tiny_model_dir, demo_model_path()):
        assert read_model_config(str(directory)).facts() == transformers_facts(directory)
    assert read_model_config("demo").train_len == 256


def test_what_cannot_be_read(tmp_path):
    Phi3Config().save_pretrained(tmp_path / "phi3")
    with pytest.raises(UnsupportedModelError, match=r"'phi3' model; gali supports Llama, Mistral, Qwen2, Qwen3, "
                                                    r"Gemma 3$"):
        read_model_config(str(tmp_path / "phi3"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"cannot load model .*: no config.json in it"):
        read_model_config(str(tmp_path / "empty"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(ModelLoadError, match="cannot load model"):
        read_model_config(str(tmp_path / "broken"))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": "many"}')
    with pytest.raises(ModelLoadError, match=r"num_hidden_layers|many"):
        read_model_config(str(tmp_path / "odd"))


def test_a_gguf_header_reads_as_transformers_reads_the_file(tiny_gguf):
    """gali info reads a GGUF's header; loading takes the config transformers makes of the same file, and holds
    its weights in the bytes gali info names."""
    from gali_cli.engine.seam.packed_modules import PackedLinear
    from gali_cli.loading import load_config, load_model

    config = load_config(str(tiny_gguf))
    model = load_model(str(tiny_gguf), device="cpu").model
    held = {id(m.group): m.group for m in model.modules() if isinstance(m, PackedLinear)}
    held[id(model.get_input_embeddings().grid)] = model.get_input_embeddings().grid
    weights = sum(w.nbytes() if hasattr(w, "nbytes") and callable(w.nbytes) else w.numel() * w.element_size()
                  for w in held.values()) + sum(p.numel() * 4 for p in model.parameters())
    expected = {"architecture": (config.architectures or ["LlamaForCausalLM"])[0],
                "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                "vocab_size": config.vocab_size, "train_len": config.max_position_embeddings,
                "rope": dict(config.rope_parameters or {}), **LLAMA, "weights_mib": round(weights / 2**20, 1)}
    assert read_model_config(str(tiny_gguf)).facts() == expected


def test_a_gguf_of_another_architecture_is_refused(tiny_model_dir, tmp_path):
    from helpers.gguf_files import write_gguf

    path = write_gguf(tmp_path / "other.gguf", tiny_model_dir, architecture="gemma3")
    with pytest.raises(UnsupportedModelError):
        read_model_config(str(path))


@pytest.mark.parametrize("config, message", [
    ({"num_hidden_layers": 10**7}, "num_hidden_layers is 10000000: a model's lies between 1 and 1,024"),
    ({"num_hidden_layers": True}, "num_hidden_layers is True: not a whole number"),
    ({"hidden_size": 64.0}, "hidden_size is 64.0: not a whole number"),
    ({"hidden_size": 100, "num_attention_heads": 3, "num_key_value_heads": 1},
     "hidden_size is 100: it is not a multiple of num_attention_heads (3)"),
    ({"head_dim": 7}, "head_dim is 7: rotary positions need an even head dimension"),
    ({"num_hidden_layers": 1024, "hidden_size": 131072, "num_attention_heads": 1024},
     "parameters, past any Llama's"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps is -1e-06: it must not be negative"),
    ({"rope_scaling": "yarn"}, "rope_scaling is 'yarn': not a JSON object"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 0}},
     "rope_scaling.original_max_position_embeddings is 0: not a window a model has"),
    ({"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0, float("inf")], "short_factor": [1.0]}},
     "rope_scaling.long_factor is inf: not a finite number"),
    ({"max_position_embeddings": 2**40}, "max_position_embeddings is 1099511627776"),
], ids=["10^7 layers", "a boolean", "a float", "heads not dividing hidden", "odd head_dim", "too many parameters",
        "negative eps", "rope_scaling a string", "zero original window", "infinite longrope factor", "2^40 window"])
def test_an_insane_config_is_refused_naming_the_field(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    with pytest.raises(ModelLoadError, match=re.escape(message)) as error:
        read_model_config(str(tmp_path))
    assert f"cannot load model {str(tmp_path)!r}: its config's" in str(error.value)


GEMMA3 = {"model_type": "gemma3_text", "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
          "query_pre_attn_scalar": 256, "final_logit_softcapping": None, "sliding_window": 512}


@pytest.mark.parametrize("config, message", [
    ({"layer_types": "full_attention"}, "layer_types is 'full_attention': not a list of one kind per layer (2)"),
    ({"layer_types": ["full_attention"]}, "layer_types is ['full_attention']: not a list of one kind per layer (2)"),
    ({"layer_types": ["full_attention", "global"]},
     "layer_types is 'global': a layer's kind is 'full_attention' or 'sliding_attention'"),
    ({"layer_types": [None, {}]}, "layer_types is None: a layer's kind is"),
    ({"query_pre_attn_scalar": "256"}, "query_pre_attn_scalar is '256': not a number"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar is 0: it must be positive"),
    ({"final_logit_softcapping": 0}, "final_logit_softcapping is 0: it must be positive"),
    ({"final_logit_softcapping": -30.0}, "final_logit_softcapping is -30.0: it must be positive"),
    ({"attn_implementation": "kernels-community/flash-attn2"},
     "attn_implementation is 'kernels-community/flash-attn2': not an attention transformers has; a kernel from the "
     "Hub is code gali never runs"),
    ({"_attn_implementation": {"": "org/kernel@v1:attention"}}, "_attn_implementation is 'org/kernel@v1:attention'"),
], ids=["layer_types a string", "too few layer kinds", "an unknown kind", "a kind not a string", "scalar a string",
        "zero scalar", "zero softcap", "negative softcap", "a hub kernel", "a hub kernel per sub-config"])
def test_a_malformed_gemma3_config_is_refused_naming_the_field(tmp_path, config, message):
    """Gemma 3's layer kinds, query scaling and logit soft-cap went unchecked: a malformed one was an "unexpected"
    error (exit 1), a final_logit_softcapping of 0 or less an empty answer with exit 0. An attention naming a Hub
    kernel would have transformers download and run it."""
    (tmp_path / "config.json").write_text(json.dumps({**GEMMA3, **config}))
    with pytest.raises(ModelLoadError, match=re.escape(message)) as error:
        read_model_config(str(tmp_path))
    assert f"cannot load model {str(tmp_path)!r}: its config's" in str(error.value)


def test_a_sound_gemma3_config_passes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**GEMMA3, "final_logit_softcapping": 30.0,
                                                      "attn_implementation": "sdpa"}))
    assert read_model_config(str(tmp_path)).family == "Gemma 3"
