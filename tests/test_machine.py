"""model/machine.py: the machine's facts without importing torch where torch could not see a GPU anyway."""

import sys

import pytest
import torch

import gali_cli.model.machine as machine
from gali_cli.errors import ConfigError
from gali_cli.model.machine import TorchBuild, choose_device, choose_dtype, environment_facts, gpu_possible, torch_build


def test_torch_build_is_read_as_torch_says():
    build = torch_build()
    assert (build.version, build.cuda, build.hip) == (torch.__version__, torch.version.cuda, torch.version.hip)


@pytest.mark.parametrize("build, platform, files, possible", [
    (None, "linux", [], False),
    (TorchBuild("2.13.0+cpu", None, None), "linux", ["/dev/nvidiactl"], False),  # a CPU build sees no GPU
    (TorchBuild("2.13.0", "12.8", None), "linux", [], False),  # no driver
    (TorchBuild("2.13.0", "12.8", None), "linux", ["/dev/nvidiactl"], True),
    (TorchBuild("2.13.0", "12.8", None), "linux", ["/dev/dxg"], True),  # WSL
    (TorchBuild("2.13.0", "12.8", None), "linux", ["/dev/kfd"], False),  # an AMD driver, a CUDA build
    (TorchBuild("2.13.0+rocm6.4", None, "6.4"), "linux", ["/dev/kfd"], True),
    (TorchBuild("2.13.0", "12.8", None), "win32", [], True),  # elsewhere, torch is asked
])
def test_a_gpu_is_possible_only_with_a_gpu_build_and_its_driver(monkeypatch, build, platform, files, possible):
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(machine.os.path, "exists", lambda path: path in files)
    assert gpu_possible(build) is possible


def test_device_and_dtype_choices():
    assert choose_device("auto", False) == "cpu" and choose_device("auto", True) == "cuda"
    with pytest.raises(ConfigError, match="no CUDA GPU is available"):
        choose_device("cuda", False)
    assert choose_dtype("auto", "cpu", True) == "float32"
    assert choose_dtype("auto", "cuda", True) == "bfloat16" and choose_dtype("auto", "cuda", False) == "float16"
    assert choose_dtype("float16", "cpu", False) == "float16"
    with pytest.raises(ConfigError, match="--dtype"):
        choose_dtype("fp8", "cpu", False)


def test_environment_facts_agree_with_torch():
    facts = environment_facts("auto", "auto")
    assert facts["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert facts["torch"] == torch.__version__ and len(facts["cuda"]) == torch.cuda.device_count()
    assert facts["bitsandbytes"].startswith(("bitsandbytes ", "unavailable"))
    assert set(facts) == {"device", "dtype", "cuda", "bitsandbytes", "noisy_attention", "torch", "transformers",
                          "transformers_tested"}
