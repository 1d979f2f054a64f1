"""The RoPE-scaling methods (methods/rope_scaling.py: NTK, dynamic NTK, YaRN): NTK's formula, transformers' own
rope types, and models with a scaling of their own refused."""


import pytest
import torch
from helpers.tiny_models import prompt
from transformers import LlamaForCausalLM

from gali_cli import ConfigError
from gali_cli.config import MethodSettings
from gali_cli.methods.rope_scaling import ntk_theta
from gali_cli.patching import apply_method


def test_static_ntk_follows_its_formula(make_llama):
    model = make_llama(train_len=16)
    apply_method(model, "ntk", MethodSettings(factor=4), 64)
    head_dim = 8
    theta = ntk_theta(10000.0, 4, head_dim)
    assert theta == pytest.approx(10000.0 * 4 ** (8 / 6))
    expected = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    torch.testing.assert_close(model.model.rotary_emb.rescaled.inv_freq, expected)


@pytest.mark.parametrize("kind, parameters, window", [
    ("dynamic-ntk", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0}, 16),
    ("yarn", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 3.0, "original_max_position_embeddings": 16}, 16),
])
def test_dynamic_ntk_and_yarn_are_transformers_own(make_llama, tmp_path, kind, parameters, window):
    model = make_llama(train_len=16)
    ids = prompt(40)
    model.save_pretrained(tmp_path)
    reference = LlamaForCausalLM.from_pretrained(tmp_path, rope_parameters=parameters,
                                                 max_position_embeddings=window).eval()
    apply_method(model, kind, MethodSettings(factor=3), 40)
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_rope_scaling_refuses_models_with_their_own_scaling(make_llama):
    llama31 = make_llama(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8})
    with pytest.raises(ConfigError, match="'llama3'"):
        apply_method(llama31, "yarn", MethodSettings(), 100)
