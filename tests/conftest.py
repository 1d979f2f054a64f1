"""Shared fixtures: tiny random Llamas and tokenizers built at test time (nothing is ever downloaded). What the tests
import rather than ask for by name (builders, constants) lives in tests/helpers/."""

import os
from contextlib import ExitStack
from pathlib import Path

# Triton kernels run on the CPU through Triton's interpreter. It must be chosen before torch imports triton (triton
# decorates its own library when imported); TRITON_INTERPRET=0 tests the compiled kernels on a GPU instead.
os.environ.setdefault("TRITON_INTERPRET", "1")
# --dtype auto computes in float32 on every CPU the tests run on, native bfloat16 or not (test_machine tests both),
# so that numeric comparisons mean the same on every machine; subprocesses inherit it.
os.environ["GALI_CPU_BF16"] = "0"
# OpenMP's threads wait passively, as gali's entry point makes them wait (gali_cli.threads.prepare_openmp): torch
# loads libgomp here, before any test runs gali, and with libgomp's spinning a tiny model's float64 product took 30
# times as long on a loaded two-core machine (1.8 ms against 61 us). How threads wait, never what they compute.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from helpers.caches import backdate
from helpers.gguf_files import write_gguf

# One SIGINT stops the run, also one started in the background by a script (tests/helpers/interrupts.py).
from helpers.interrupts import pytest_configure  # noqa: F401
from helpers.tiny_models import save_tiny_llama

# The seam check's tiny random Llama: the tests' too.
from gali_cli.seam_check import tiny_llama


@pytest.fixture
def make_llama():
    return tiny_llama


@pytest.fixture
def cache_argument_renamed(monkeypatch):
    """transformers as a release that renamed the forward's cache argument again (to `kv_cache`) would be: every
    family's decoder model (LlamaModel, ...) and causal LM declare it under the new name, and the causal LM hands it
    to the model under it."""
    import transformers
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from gali_cli.engine.seam import cache_argument
    from gali_cli.model.families import FAMILIES

    def renamed(model_class):
        current, model_forward = cache_argument.cache_parameter(model_class), model_class.forward

        def renamed_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, kv_cache=None,
                                  inputs_embeds=None, use_cache=None, **kwargs):
            return model_forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 inputs_embeds=inputs_embeds, use_cache=use_cache, **{current: kv_cache}, **kwargs)

        return renamed_model_forward

    def renamed_causal_forward(self, input_ids=None, attention_mask=None, position_ids=None, kv_cache=None,
                               inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            kv_cache=kv_cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                            **kwargs).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, -logits_to_keep:]))

    for family in FAMILIES:  # each causal LM's decoder model: LlamaModel, ..., Gemma3TextModel
        model_class = transformers.AutoModel._model_mapping[getattr(transformers, family.causal_lm).config_class]
        monkeypatch.setattr(model_class, "forward", renamed(model_class))
        monkeypatch.setattr(getattr(transformers, family.causal_lm), "forward", renamed_causal_forward)
    cache_argument.forward_parameters.cache_clear()  # it remembers each class's declared parameters
    yield
    cache_argument.forward_parameters.cache_clear()


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path_factory, monkeypatch):
    """No test reads or writes the user's document cache."""
    monkeypatch.setenv("GALI_CACHE_DIR", str(tmp_path_factory.mktemp("gali-cache")))
    monkeypatch.delenv("GALI_CACHE_LIMIT", raising=False)


@pytest.fixture(autouse=True)
def _on_the_cpu(monkeypatch):
    """The commands run on the CPU, as on CI, also where there is a GPU: their float32 answers are compared with
    references computed on the CPU. tests/cli/test_cuda_commands.py runs them on a GPU."""
    monkeypatch.setenv("GALI_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (window 32) and its tokenizer on disk; its stop tokens never win a greedy pick."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), hidden=64)


@pytest.fixture(scope="session")
def _model_cache_directory(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gali-models")


@pytest.fixture(autouse=True)
def _own_model_cache(_model_cache_directory, monkeypatch):
    """No test reads or writes the user's model cache (one directory per session, so the real model's tokenizer is
    read once)."""
    monkeypatch.setenv("GALI_MODEL_CACHE", str(_model_cache_directory))


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny Llama of `tiny_model_dir` as a GGUF file (Q8_0 projections), written with the gguf package."""
    pytest.importorskip("gguf")
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf", tiny_model_dir)


@pytest.fixture
def running_workspace():
    """The workspace of a write that a running gali (here, this process) is making, `size` bytes so far."""
    from gali_cli.cache_ownership import workspace

    with ExitStack() as stack:
        def writing(directory: Path, kind: str, size: int) -> Path:
            directory.mkdir(parents=True, exist_ok=True)
            folder = stack.enter_context(workspace(directory, kind))
            (folder / "part").write_bytes(bytes(size))
            backdate(folder)
            return folder

        yield writing


@pytest.fixture
def fresh_kernel(tmp_path, monkeypatch):
    """A native kernel directory of the test's own and no remembered build or check (restored afterwards)."""
    from gali_cli.engine.attention import noisy_attention
    from gali_cli.engine.kernels import native_library

    monkeypatch.setattr(native_library, "kernel_directory", lambda: tmp_path / "kernels")
    native_library.load_kernel.cache_clear()
    noisy_attention.native_verified.cache_clear()
    yield tmp_path / "kernels"
    native_library.load_kernel.cache_clear()
    noisy_attention.native_verified.cache_clear()
