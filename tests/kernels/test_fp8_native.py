"""The native fp8 kernel: every SIMD level bit-exact, its scratch cap, build cache and fallbacks;
the kernel / thread knobs and the per-expert choice of worker count."""

from __future__ import annotations

import logging
import os
import platform
import shutil
from pathlib import Path

import pytest

from support.hostile import evil_library, hostile_user  # noqa: F401 (a fixture)
from support.subproc import call
from support.tiers import TORCH_ABSENT

torch = pytest.importorskip("torch", reason=TORCH_ABSENT)
from drama3_patches.kernels import fp8 as k8  # noqa: E402
from drama3_patches.kernels import fp8_build, fp8_native  # noqa: E402
from drama3_patches import logger as logger_mod  # noqa: E402  (one-shot warnings: reset per test)

needs_cc = pytest.mark.skipif(fp8_build._compiler() is None, reason="no C compiler here")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _case(n: int, k: int, seed: int, magnitude: float = 1e-2):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n * k,), dtype=torch.uint8, generator=g)
    codes[: min(256, n * k)] = torch.randperm(256, generator=g)[: min(256, n * k)].to(torch.uint8)
    w = codes.view(n, k).view(torch.float8_e4m3fn)
    s = torch.rand(k8.expected_scale_shape((n, k)), generator=g) * magnitude + magnitude / 16
    return w, s


# Builds that take the AVX2 path, the SSE4.1 path and the plain-C table (flags after -march=native win).
LEVELS = {2: (), 1: ("-mno-avx2",), 0: ("-mno-avx2", "-mno-sse4.1")}


@needs_cc
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the SIMD levels are x86 ones")
@pytest.mark.parametrize("level", sorted(LEVELS))
def test_every_simd_level_is_bit_exact(level):
    lib = fp8_native._open(fp8_build.build(extra_flags=LEVELS[level]))
    if lib.d3_fp8_simd_level() != level:
        pytest.skip(f"this CPU/compiler gives level {lib.d3_fp8_simd_level()} for flags {LEVELS[level]}")
    nan_bits = fp8_native.torch_nan_bits()
    assert fp8_native._self_check(lib, nan_bits) is None
    for (n, k), mag in (((257, 130), 1e-2), ((1030, 520), -7.0), ((64, 600), 2.0**119), ((520, 33), 1e-40)):
        w, s = _case(n, k, n + k, mag)
        s.view(-1)[0] = float("inf")
        ref = k8.reference_dequant(w, s)
        for transposed in (False, True):
            for threads in (1, 3):
                out = torch.empty((k, n) if transposed else (n, k), dtype=torch.bfloat16)
                fp8_native._call(lib, w.view(torch.uint8), s, out, transposed, (128, 128), threads, nan_bits)
                assert torch.equal(_bits(out), _bits(ref.t() if transposed else ref)), (level, n, k, transposed)


@needs_cc
def test_workers_are_capped_so_scratch_stays_within_half_an_expert():
    # One transposed unit (128 columns x 512 rows of codes) and its tables per worker: a
    # 512 x 256 expert (n*k = 128 KiB) affords one worker however many are asked for; a big
    # one gets them all.  Results are the same bits either way.
    for (n, k), asked, want in (((512, 256), 8, 1), ((4096, 1024), 8, 8), ((4096, 1024), 3, 3)):
        w, s = _case(n, k, 3)
        out = torch.empty(k, n, dtype=torch.bfloat16)
        used = fp8_native.expand(w.view(torch.uint8), s, out, transposed=True, block_size=(128, 128), threads=asked)
        assert used == want, (n, k, asked, used)
        assert torch.equal(_bits(out), _bits(k8.reference_dequant(w, s).t()))


@needs_cc
@pytest.mark.parametrize("extra", sorted(set(LEVELS.values()) if platform.machine() in ("x86_64", "AMD64") else {()}))
def test_the_c_source_compiles_without_warnings(tmp_path, extra):
    """fp8_expand.c under -Wall -Wextra -Werror, with the build's own flags (each SIMD level on x86)."""
    import subprocess

    cc = fp8_build._compiler()
    src = Path(fp8_build.__file__).with_name(fp8_build.SOURCE_NAME)
    argv = [*cc.split(), *fp8_build._flags(True), *extra, "-Wall", "-Wextra", "-Werror", "-o", str(tmp_path / "k.so"),
            str(src)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


@needs_cc
def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    first = fp8_build.build(cache_dir=tmp_path)
    assert first.parent == tmp_path and first.is_file()
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no half-written leftovers

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again although the library is cached")

    monkeypatch.setattr(fp8_build, "_compile", no_compile)
    assert fp8_build.build(cache_dir=tmp_path) == first


def test_no_compiler_falls_back_to_the_torch_path(monkeypatch, caplog):
    monkeypatch.setattr(fp8_native, "_STATE", {})
    monkeypatch.setattr(fp8_build, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert fp8_native.available() is False
    assert "no C compiler" in fp8_native.unavailable_reason()
    assert any("native kernel unavailable" in r.getMessage() for r in caplog.records)
    assert k8.resolve_kernel() == "torch" and k8.resolve_kernel("auto") == "torch"
    with pytest.raises(RuntimeError, match="no C compiler"):
        k8.resolve_kernel("native")
    w, s = _case(130, 300, 1)
    got = k8.dequant_experts([w], [s], torch.empty(1, 300, 130, dtype=torch.bfloat16))
    assert torch.equal(_bits(got[0]), _bits(k8.reference_dequant(w, s).t()))


@needs_cc
def test_a_failed_self_check_disables_the_kernel(monkeypatch):
    monkeypatch.setattr(fp8_native, "_STATE", {})
    monkeypatch.setattr(fp8_native, "_self_check", lambda lib, nan_bits: "self-check mismatch (injected)")
    assert fp8_native.load() is None
    assert fp8_native.unavailable_reason() == "self-check mismatch (injected)"
    assert k8.resolve_kernel() == "torch"


@needs_cc
def test_a_compile_error_is_reported_with_the_compiler_output(monkeypatch, tmp_path):
    bad = fp8_build.source() + "\nthis is not C;\n"
    monkeypatch.setattr(fp8_build, "source", lambda: bad)
    with pytest.raises(RuntimeError, match="building the fp8 kernel failed.*error"):
        fp8_build.build(cache_dir=tmp_path)


def test_kernel_knob(monkeypatch, caplog):
    monkeypatch.setenv(k8.KERNEL_ENV, "torch")
    assert k8.resolve_kernel() == "torch"
    assert k8.resolve_kernel("torch") == "torch"
    with pytest.raises(ValueError, match="kernel must be one of"):
        k8.resolve_kernel("cuda")
    monkeypatch.setattr(logger_mod, "_warned", set())
    monkeypatch.setenv(k8.KERNEL_ENV, "fastest")
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert k8.resolve_kernel() in ("native", "torch")  # auto
    assert any("DRAMA3_PATCHES_FP8_KERNEL='fastest'" in r.getMessage() for r in caplog.records)


def test_threads_knob(monkeypatch, caplog):
    monkeypatch.setenv(k8.THREADS_ENV, "3")
    assert k8.default_threads() == 3
    monkeypatch.delenv(k8.THREADS_ENV)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    assert k8.default_threads() == min(64, len(os.sched_getaffinity(0)), 8)
    monkeypatch.setattr(logger_mod, "_warned", set())
    monkeypatch.setenv(k8.THREADS_ENV, "many")
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert k8.default_threads() >= 1
    assert any("not a positive integer" in r.getMessage() for r in caplog.records)
    assert k8._env_threads() is None  # so an invalid value leaves the per-expert choice on


def test_adaptive_choice_tries_both_keeps_the_faster_and_probes_again():
    a = k8._AdaptiveThreads(4)
    seen = []
    for i in range(20):
        t = a.choose()
        seen.append(t)
        a.record(t, {4: 1.0, 1: 3.0}[t] if i < 10 else {4: 5.0, 1: 1.0}[t])  # the host gets busy at 10
    assert seen[:2] == [4, 1]
    assert seen[2:7] == [4] * 5 and seen[7] == 1  # the slower is probed again at the 8th expert
    assert seen[-3:] == [1, 1, 1]  # after the load changed, one worker wins
    assert k8._AdaptiveThreads(1).options == (1,)


def _record_threads(monkeypatch):
    calls = []
    real = fp8_native.expand

    def spy(*args, threads, **kwargs):
        calls.append(threads)
        return real(*args, threads=threads, **kwargs)

    monkeypatch.setattr(fp8_native, "expand", spy)
    return calls


@needs_cc
def test_experts_choose_their_worker_count_unless_it_is_fixed(monkeypatch):
    e = 10
    w = [_case(256, 384, i)[0] for i in range(e)]
    s = [_case(256, 384, i)[1] for i in range(e)]
    out = torch.empty(e, 384, 256, dtype=torch.bfloat16)
    calls = _record_threads(monkeypatch)
    monkeypatch.setenv(k8.THREADS_ENV, "4")  # the operator's knob fixes the count
    k8.dequant_experts(list(w), list(s), out, kernel="native")
    assert calls == [4] * e
    monkeypatch.delenv(k8.THREADS_ENV)
    calls.clear()
    k8.dequant_experts(list(w), list(s), out, kernel="native", num_threads=2)  # so does the argument
    assert calls == [2] * e
    calls.clear()
    monkeypatch.setattr(k8, "default_threads", lambda: 3)
    k8.dequant_experts(list(w), list(s), out, kernel="native")  # the default: measured per expert
    assert calls[:2] == [3, 1] and set(calls) <= {1, 3} and len(calls) == e
    assert all(torch.equal(_bits(out[i]), _bits(k8.reference_dequant(w[i], s[i]).t())) for i in range(e))


# ------------------------------------------------ trust: what another user could have planted


def load_kernel(version_timeout=None) -> dict:
    """Runs in a fresh interpreter: load the kernel as a serving process does."""
    from drama3_patches.kernels import fp8_build
    from drama3_patches.kernels import fp8_native as native

    if version_timeout is not None:
        fp8_build.VERSION_TIMEOUT_S = version_timeout
    lib = native.load()
    return {"available": lib is not None, "reason": native.unavailable_reason(), "path": str(native.info()["path"])}


def _library_name(scratch) -> str:
    """The cache name this host's build gets (anyone on the host can compute it)."""
    return fp8_build.build(cache_dir=scratch).name


def _load_in_child(env: dict, **kw) -> dict:
    got = call(load_kernel, *kw.values(), env=env, timeout=120, with_output=True)
    return dict(got["result"], stderr=got["stderr"])


@needs_cc
def test_a_cache_folder_open_to_others_is_refused_and_its_library_never_loaded(tmp_path):
    marker = tmp_path / "marker"
    evil = evil_library(tmp_path, marker)
    name = _library_name(tmp_path / "scratch")
    cache = tmp_path / "open"
    cache.mkdir()
    cache.chmod(0o777)
    shutil.copy(evil, cache / name)
    got = _load_in_child({"DRAMA3_PATCHES_CACHE_DIR": str(cache)})
    assert not marker.exists(), "the planted library's constructor ran"
    assert got["available"], got
    assert f"DRAMA3_PATCHES_CACHE_DIR={cache} is refused" in got["stderr"]
    assert "writable by group or others" in got["stderr"]
    assert not got["path"].startswith(str(cache))
    assert not Path(got["path"]).parent.exists()  # the private temporary folder is gone after loading


@needs_cc
@pytest.mark.parametrize("plant", ["symlink", "fifo"])
def test_a_link_or_fifo_at_the_library_name_is_not_followed(tmp_path, plant):
    marker = tmp_path / "marker"
    evil = evil_library(tmp_path, marker)
    name = _library_name(tmp_path / "scratch")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    if plant == "symlink":
        (cache / name).symlink_to(evil)
    else:
        os.mkfifo(cache / name)
    got = _load_in_child({"DRAMA3_PATCHES_CACHE_DIR": str(cache)})
    assert not marker.exists(), "the planted library's constructor ran"
    assert got["available"], got
    assert "is refused" in got["stderr"]
    assert ("link" if plant == "symlink" else "not a regular file") in got["stderr"]


@needs_cc
def test_a_private_cache_is_created_0700_and_used(tmp_path):
    cache = tmp_path / "made" / "here"
    got = _load_in_child({"DRAMA3_PATCHES_CACHE_DIR": str(cache)})
    assert got["available"] and got["stderr"] == "", got
    assert cache.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in cache.iterdir()] == [Path(got["path"]).name]
    again = _load_in_child({"DRAMA3_PATCHES_CACHE_DIR": str(cache)})
    assert again["path"] == got["path"] and again["stderr"] == ""


@needs_cc
def test_a_truncated_library_is_rebuilt_once(tmp_path):
    cache = tmp_path / "cache"
    name = fp8_build.build(cache_dir=cache).name
    with open(cache / name, "r+b") as f:
        f.truncate(100)
    got = _load_in_child({"DRAMA3_PATCHES_CACHE_DIR": str(cache)})
    assert got["available"], got
    assert "does not load" in got["stderr"] and "building it again" in got["stderr"]
    assert (cache / name).stat().st_size > 100


def test_a_hung_compiler_times_out(tmp_path):
    cc = tmp_path / "slow-cc"
    cc.write_text("#!/bin/sh\nsleep 120\n")
    cc.chmod(0o755)
    got = _load_in_child({"CC": str(cc), "DRAMA3_PATCHES_CACHE_DIR": str(tmp_path / "cache")}, version_timeout=1)
    assert not got["available"]
    assert "did not finish within 1 s" in got["reason"]


@needs_cc
def test_another_users_planted_library_never_runs_in_this_process(tmp_path, hostile_user):
    # The attacker prepares, in a shared /tmp-like folder: the old fallback folder with a library
    # under the name this host's build gets, and an explicit cache folder of theirs.
    marker = tmp_path / "marker"
    evil = evil_library(hostile_user.shared, marker)
    name = _library_name(tmp_path / "scratch")
    theirs = hostile_user.shared / "cache"
    fallback = hostile_user.shared / f"drama3_patches-{os.getuid()}"
    for folder in (theirs, fallback):
        hostile_user.sh('mkdir -m 777 "$1" && cp "$2" "$1/$3" && chmod 777 "$1/$3"', folder, evil, name)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    for env in ({"DRAMA3_PATCHES_CACHE_DIR": str(theirs)},
                # the home cache cannot be made: the old code fell back to $TMPDIR/drama3_patches-<uid>
                {"XDG_CACHE_HOME": str(not_a_folder), "TMPDIR": str(hostile_user.shared)}):
        got = _load_in_child(env)
        assert not marker.exists(), f"the planted library ran in this process ({env})"
        assert got["available"], got
        assert "private temporary folder" in got["stderr"]
    # An empty folder they made, open to all: nothing is built there for them to swap later.
    hostile_user.sh('rm -rf "$1"/* && chmod 777 "$1"', theirs)
    got = _load_in_child({"DRAMA3_PATCHES_CACHE_DIR": str(theirs)})
    assert got["available"] and list(theirs.iterdir()) == []
    assert f"belongs to uid {hostile_user.uid}" in got["stderr"]


def fork_while_another_thread_builds() -> list:
    """Runs in a fresh interpreter: fork while a thread holds the build lock; can the child load?"""
    import threading

    from drama3_patches.kernels import fp8_build
    from drama3_patches.kernels import fp8_native as native
    from support.fork_build import fork_and_load

    fp8_build._compiler = lambda: None  # the child's load() then ends at once, if it can take the lock
    holding, release = threading.Event(), threading.Event()

    def builder():
        with native._LOCK:
            holding.set()
            release.wait(60)

    threading.Thread(target=builder, daemon=True).start()
    holding.wait(10)
    code = fork_and_load(native, 20)
    release.set()
    return [code, native.load() is None]


def test_a_fork_while_another_thread_builds_does_not_deadlock_the_child():
    # exit 3: the child's load() was still waiting for the lock after 20 s
    assert call(fork_while_another_thread_builds, timeout=120) == [0, True]


@needs_cc
def test_a_fork_one_second_into_a_slow_build_does_not_deadlock_the_child(tmp_path):
    """A fresh interpreter imports only fp8_native, starts load() in a thread with a compiler that
    sleeps 3 s before compiling, and forks one second later: the child's own load() returns (exit 0,
    not 3). Before torch was imported at module import, the fork could land inside the build's
    ``import torch`` and the child waited forever on that module's import lock."""
    from support.fork_build import fork_one_second_into_a_slow_build

    real = shutil.which(fp8_build._compiler().split()[0])
    cc = tmp_path / "slow-cc"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *--version*) ;; *) sleep 3 ;; esac\nexec {real} "$@"\n')
    cc.chmod(0o755)
    got = call(fork_one_second_into_a_slow_build, env={"CC": str(cc), "DRAMA3_PATCHES_CACHE_DIR": str(tmp_path / "c")},
               timeout=240)
    assert got == {"child": 0, "torch_at_import": True, "parent_loaded": True}



def test_the_fp8_pair_imports_one_way():
    """fp8 chooses and calls fp8_native; fp8_native needs only the format leaf and its build, not fp8.
    (A ``python -c`` child: this test module itself imports fp8.)"""
    from support.subproc import run_python

    loaded = run_python("""
        import sys
        import drama3_patches.kernels.fp8_native
        print(sorted(m for m in sys.modules if m.startswith("drama3_patches.kernels.fp8")))
    """).stdout.strip()
    assert loaded == str(["drama3_patches.kernels.fp8_build", "drama3_patches.kernels.fp8_format",
                          "drama3_patches.kernels.fp8_native"])
    assert k8.fp8_native is fp8_native and k8.reference_dequant is fp8_native.reference_dequant
