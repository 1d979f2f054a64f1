"""model/machine.py: the machine's facts without importing torch where torch could not see a GPU anyway."""

import sys

import pytest
import torch

import gali_cli.model.machine as machine
from gali_cli.errors import ConfigError
from gali_cli.model.machine import (
    TorchBuild,
    choose_device,
    choose_dtype,
    cpu_bf16,
    environment_facts,
    gpu_possible,
    torch_build,
)


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
    assert choose_dtype("auto", "cpu", False) == "float32" and choose_dtype("auto", "cpu", True) == "bfloat16"
    assert choose_dtype("auto", "cuda", True) == "bfloat16" and choose_dtype("auto", "cuda", False) == "float16"
    assert choose_dtype("float16", "cpu", False) == "float16"
    with pytest.raises(ConfigError, match="--dtype"):
        choose_dtype("fp8", "cpu", False)


def test_environment_facts_agree_with_torch():
    facts = environment_facts("auto", "auto", lambda device, dtype: f"{device} {dtype}")
    assert facts["noisy_attention"] == f"{facts['device']} {facts['dtype']}"
    assert facts["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert facts["torch"] == torch.__version__ and len(facts["cuda"]) == torch.cuda.device_count()
    assert facts["bitsandbytes"].startswith(("bitsandbytes ", "unavailable"))
    assert set(facts) == {"device", "dtype", "cuda", "bitsandbytes", "noisy_attention", "torch", "transformers",
                          "transformers_tested"}


@pytest.mark.parametrize(("text", "native"), [
    ("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n", True),  # Sapphire Rapids' AMX
    ("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n", False),  # AVX-512 BF16 alone: measured slower
    ("flags\t\t: fpu sse2 avx2 avx512f avx512bw\n", False),
    ("Features\t: fp asimd bf16 i8mm\n", False),  # Arm BF16: not measured, float32 stays
    ("", False),
])
def test_cpu_bf16_reads_the_cpu_flags(tmp_path, monkeypatch, text, native):
    monkeypatch.delenv("GALI_CPU_BF16")
    (tmp_path / "cpuinfo").write_text(text)
    assert cpu_bf16(str(tmp_path / "cpuinfo")) is native


def test_cpu_bf16_override_and_unreadable(tmp_path, monkeypatch):
    (tmp_path / "cpuinfo").write_text("flags\t\t: amx_bf16\n")
    monkeypatch.setenv("GALI_CPU_BF16", "0")
    assert cpu_bf16(str(tmp_path / "cpuinfo")) is False
    monkeypatch.setenv("GALI_CPU_BF16", "1")
    assert cpu_bf16(str(tmp_path / "missing")) is True
    monkeypatch.delenv("GALI_CPU_BF16")
    assert cpu_bf16(str(tmp_path / "missing")) is False


def test_auto_dtype_follows_the_cpu(monkeypatch):
    from gali_cli.loading import resolve_dtype

    monkeypatch.setenv("GALI_CPU_BF16", "1")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert environment_facts("cpu", "auto", lambda *_: "")["dtype"] == "bfloat16"
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    monkeypatch.setenv("GALI_CPU_BF16", "0")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert environment_facts("cpu", "auto", lambda *_: "")["dtype"] == "float32"
