"""gali_cli.threads: the CPU thread count a run chooses, OpenMP's wait policy set before torch loads, and what -v
says about both."""

import os
import subprocess
import sys

import pytest
import torch
from helpers.timing import scaled
from typer.testing import CliRunner

import gali_cli.cli as cli
from gali_cli.threads import choose_threads


def test_threads_then_omp_num_threads_then_torch_decide(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 7.5, 7.5))
    assert choose_threads(6, torch_default=4).describe().startswith("threads: 6 (--threads)")
    assert choose_threads(None, torch_default=4).describe().startswith("threads: 4 (torch's default, the physical "
                                                                       "cores; load 7.5)")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(None, torch_default=3).describe().startswith("threads: 3 (OMP_NUM_THREADS; load 7.5)")


def test_a_run_uses_its_threads_and_gives_them_back(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    doc = tmp_path / "doc.txt"
    doc.write_text("The cat sat on the mat. " * 40)
    before = torch.get_num_threads()
    runner = CliRunner()
    result = runner.invoke(cli.app, ["summarize", str(doc), "-m", str(tiny_model_dir), "--max-new-tokens", "3",
                                     "--no-cache", "-v"], env={"GALI_THREADS": "1"})
    assert result.exit_code == 0, result.stderr
    assert "threads: 1 (--threads); OpenMP waits PASSIVE" in result.stderr
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(("policy", "spin_count"), [(None, "0"), pytest.param("ACTIVE", "30000000000",
                                                                               marks=pytest.mark.slow)])
def test_openmp_waits_without_spinning_unless_the_user_chose(tiny_model_dir, tmp_path, policy, spin_count):
    """libgomp reads OMP_WAIT_POLICY once, when torch loads it: its own report (OMP_DISPLAY_ENV) shows what took
    effect. Spinning threads took 15x the decode time on a loaded 2-CPU machine (benchmarks/bench_threads.py)."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The cat sat on the mat. " * 40)
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    env |= {"OMP_DISPLAY_ENV": "VERBOSE", **({"OMP_WAIT_POLICY": policy} if policy else {})}
    result = subprocess.run([sys.executable, "-m", "gali_cli", "ppl", str(doc), "-m", str(tiny_model_dir),
                             "--max-tokens", "40", "--threads", "2"], capture_output=True, text=True, env=env,
                            timeout=scaled(300))
    assert result.returncode == 0, result.stderr
    assert f"GOMP_SPINCOUNT = '{spin_count}'" in result.stderr


@pytest.mark.parametrize("how", ["--threads", "GALI_THREADS"])
def test_a_thread_count_past_four_per_cpu_is_a_usage_error_before_anything_loads(monkeypatch, capsys, how):
    """--threads 100000 started that many OpenMP threads, then torch failed and segfaulted (exit 139): now the
    count is refused when parsed, from the flag and from the environment alike."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", lambda count: pytest.fail("threads were set"))
    arguments = ["summarize", "missing.txt", "-m", "demo"]
    if how == "--threads":
        arguments += ["--threads", "100000"]
    else:
        monkeypatch.setenv("GALI_THREADS", "100000")
    assert cli.main(arguments) == 2
    error = capsys.readouterr().err
    assert "'--threads' (env var: 'GALI_THREADS'): 100000 threads is more than 4 per CPU (8 on this machine's 2 " \
           "CPUs)" in error
    assert len(error.strip().splitlines()) == 1
    monkeypatch.delenv("GALI_THREADS", raising=False)
    assert cli.main(["summarize", "missing.txt", "-m", "demo", "--threads", "8"]) == 3  # 8 passes: the file is next
