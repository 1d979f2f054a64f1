"""The native library (kernels/native_library.py): built once per machine and kept, a compiler that fails or hangs
remembered, a machine without one on the PyTorch path, and rows shared among threads where OpenMP does not."""

import dataclasses
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers.attention import qkv
from helpers.timing import scaled

import gali_cli.engine.attention.noisy_attention as noisy_attention
import gali_cli.engine.kernels.native_library as native_library
import gali_cli.engine.kernels.native_noise as native_noise
from gali_cli.engine.attention.choice import plan_for
from gali_cli.engine.attention.noisy_attention import explicit_noisy_partial
from gali_cli.engine.math.noise import Noise
from gali_cli.errors import GaliWarning


def test_the_kernel_is_built_once_and_checked(fresh_kernel):
    assert noisy_attention.native_verified()
    libraries = list(fresh_kernel.glob("native-*"))
    assert len(libraries) == 1
    native_library.load_kernel.cache_clear()
    built = libraries[0].stat().st_mtime_ns
    native_library.load_kernel()
    assert libraries[0].stat().st_mtime_ns == built  # reused, not rebuilt


def test_an_edit_to_any_of_the_librarys_files_builds_it_anew(fresh_kernel, tmp_path, monkeypatch):
    """The library is made of several files (the kernels' C sources and their header): its cache key holds each of
    them, so that an edited one is never served a library built before the edit."""
    copies = tmp_path / "sources"
    copies.mkdir()
    files = tuple(copies / path.name for path in native_library.BUILT_FROM)
    for path in native_library.BUILT_FROM:
        shutil.copy(path, copies / path.name)
    monkeypatch.setattr(native_library, "BUILT_FROM", files)
    built = []

    def recorded(command, library):
        built.append(library.name)
        raise native_library.KernelBuildError("not built here")

    monkeypatch.setattr(native_library, "_build", recorded)

    def key() -> str:
        native_library.load_kernel.cache_clear()
        with pytest.raises(native_library.KernelBuildError, match="not built here"):
            native_library.load_kernel()
        return built[-1]

    first = key()
    assert key() == first  # the same files: the same library
    keys = {first}
    for path in files:
        path.write_bytes(path.read_bytes() + b"\n")
        keys.add(key())
    assert len(keys) == len(files) + 1


def test_no_compiler_means_the_pytorch_path_and_one_warning(fresh_kernel, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.delenv("GALI_KERNEL", raising=False)
    query, key, value = qkv(1, 2, 1, 4, 8)
    with pytest.warns(GaliWarning, match="native noise kernel cannot be built here"):
        assert plan_for(query, key, value, noise=True).noisy == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan_for(query, key, value, noise=True).noisy == "torch"  # checked once: no second warning


def test_a_kernel_without_openmp_shares_rows_through_a_thread_pool(monkeypatch):
    """A compiler without OpenMP (Apple's) builds a kernel that does the rows it is given: the rows are then shared
    by a thread pool, with the same result as one call."""
    kernel = native_library.load_kernel()
    monkeypatch.setattr(native_noise, "load_kernel", lambda: dataclasses.replace(kernel, threaded=False))
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        query, key, value = qkv(2, 6, 2, 40, 700, seed=5)
        arguments = (query, key, value, 0.25, Noise(seed=2, layer=1, scale=2.0), 700, 4, 650, 740)
        with torch.inference_mode():
            got = native_noise.noisy_partial(*arguments)
    finally:
        torch.set_num_threads(threads)
    expected = explicit_noisy_partial(*arguments)
    torch.testing.assert_close(got.output, expected.output, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(got.lse, expected.lse, rtol=1e-5, atol=2e-5)


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie waiting for its reaper counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.fixture
def short_kernel_directory(fresh_kernel, monkeypatch):
    """A kernel directory with a short path, as ~/.cache/gali/kernels is: the warnings quote it, within 200
    characters."""
    short = Path(tempfile.mkdtemp(prefix="gali-"))
    monkeypatch.setattr(native_library, "kernel_directory", lambda: short / "kernels")
    yield short
    shutil.rmtree(short, ignore_errors=True)


def test_a_compiler_that_hangs_is_killed_with_its_children_and_remembered(short_kernel_directory, monkeypatch):
    """A $CC that hung stalled every run 120 s per build attempt, orphaned its child each time, and was reported as
    "no C compiler", cut mid-command: now the build is bounded, its whole process group killed, the failure
    remembered for that compiler, and the warning says so in one whole line."""
    tmp_path = fresh_kernel = short_kernel_directory
    runs, child = tmp_path / "runs", tmp_path / "child"
    hanging = tmp_path / "hanging-cc"
    hanging.write_text(f"#!/bin/sh\necho run >> {runs}\nsleep 300 &\necho $! > {child}\nwait\n")
    hanging.chmod(0o755)
    monkeypatch.setenv("CC", str(hanging))
    monkeypatch.delenv("GALI_KERNEL", raising=False)
    monkeypatch.setattr(native_library, "BUILD_SECONDS", 1)
    with pytest.warns(GaliWarning) as caught:
        assert not noisy_attention.native_verified()
    said = str(caught[0].message)
    assert f"{hanging} hung: killed after 1 s with its child processes; not run again: rm " in said
    assert said.endswith(".failed to retry); GALI's noise takes the slower PyTorch path")
    assert runs.read_text() == "run\n"  # one attempt: other flags would hang as well
    deadline = time.monotonic() + scaled(10)
    while not _gone(int(child.read_text())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(int(child.read_text())), "the compiler's child outlived it"
    notes = list((fresh_kernel / "kernels").glob("native-*.failed"))
    assert len(notes) == 1
    with pytest.raises(native_library.KernelBuildError, match=r"^in an earlier run, .*hanging-cc hung: killed after "
                                                            r"1 s .*; not run again: rm .* to retry$"):
        native_library.load_kernel()  # another run: told at once, the compiler not run again
    assert runs.read_text() == "run\n"
    monkeypatch.setenv("CC", "cc")  # another compiler is tried afresh
    monkeypatch.setattr(native_library, "BUILD_SECONDS", 60)
    native_library.load_kernel.cache_clear()
    assert native_library.load_kernel().function is not None


def test_a_compiler_that_fails_is_remembered_and_a_missing_one_is_not(fresh_kernel, tmp_path, monkeypatch):
    failing = tmp_path / "failing-cc"
    failing.write_text(f"#!/bin/sh\necho run >> {tmp_path / 'runs'}\necho 'error: no such flag' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    with pytest.raises(native_library.KernelBuildError, match=r"failing-cc failed: error: no such flag; not run "
                                                            r"again: rm "):
        native_library.load_kernel()
    assert (tmp_path / "runs").read_text() == "run\n" * 4  # with and without OpenMP and -march=native
    with pytest.raises(native_library.KernelBuildError, match="in an earlier run"):
        native_library.load_kernel()
    assert (tmp_path / "runs").read_text() == "run\n" * 4
    monkeypatch.setenv("CC", str(tmp_path / "not-there"))
    for _ in range(2):  # nothing ran, nothing remembered: a compiler installed later is used at once
        with pytest.raises(native_library.KernelBuildError, match=r"^no C compiler: .*not-there cannot be run \("):
            native_library.load_kernel()
    assert not list(fresh_kernel.glob("*not-there*")) and len(list(fresh_kernel.glob("native-*.failed"))) == 1
