"""Upstream stand-ins (tests/replicas/): where they are and how a forked test or a child uses them.

Two kinds, both for code that cannot import on this CPU host:

* vllm-ascend profiles (``ascend_*``): a sys.path root with a ``vllm_ascend`` package and its
  dist-info (so version guards read it). vllm-ascend is not installed here, so nothing is shadowed.
* vllm-omni NPU runner stand-ins (``omni_npu_<version>``), one per published vllm-omni: only the
  modules of ``vllm_omni/platforms/npu/worker/`` that import vllm-ascend internals (the NPU model
  runners). They are never a sys.path root: :func:`enter_npu_workers` puts their folder at the
  front of the REAL installed package's ``__path__``, so everything else -- the NPU workers
  themselves, ``vllm_omni.config``, ``worker_v2`` -- is the published code.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPLICAS = Path(__file__).resolve().parents[1] / "replicas"

ASCEND_MAIN = "ascend_main_2608"      # vllm-ascend public main, 2026-08-22 (182b75ea84)
ASCEND_032 = "ascend_032"             # vllm-ascend 0.32 as the port describes it (not public)
ASCEND_030RC2 = "ascend_030rc2"       # vllm-ascend 0.30.0rc2, the newest published source (PyPI sdist)
ASCEND_FIXED = "ascend_synthetic_fixed"  # synthetic: the Mamba manager already takes prefill_end

#: Published vllm-omni version -> its NPU runner stand-ins.
OMNI_NPU_RUNNERS = {"0.31.0rc1": "omni_npu_031rc1", "0.32.0rc1": "omni_npu_032rc1"}
NPU_WORKER_PACKAGE = "vllm_omni.platforms.npu.worker"


def profile(name: str) -> Path:
    path = REPLICAS / name
    if not path.is_dir():
        raise FileNotFoundError(f"no replica profile {name!r} under {REPLICAS}")
    return path


def profile_paths(*names: str) -> list[Path]:
    """The sys.path roots for ``names``, in order (first wins, like PYTHONPATH)."""
    return [profile(n) for n in names]


def installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def has_fish_omni() -> bool:
    """The installed vllm-omni publishes fish_omni (Drama 3; 0.32.0rc1 on). Looked up on disk:
    importing vllm-omni patches vLLM, which a test may need to come first."""
    spec = importlib.util.find_spec("vllm_omni")
    return bool(spec and spec.origin) and (Path(spec.origin).parent / "model_executor/models/fish_omni").is_dir()


FISH_OMNI_ABSENT = "this vllm-omni has no fish_omni (Drama 3 is published from vllm-omni 0.32.0rc1 on)"
needs_fish_omni = pytest.mark.skipif(not has_fish_omni(), reason=FISH_OMNI_ABSENT)

# fish_omni_model imports vLLM's qwen3_5 -> qwen3_vl -> transformers' Qwen2-VL image processor, whose
# module imports torchvision (no build loads beside CPU torch here). A child that imports the model
# module runs with the e2e tier's start-up hook, which serves that module from its PIL sibling:
# ``call(..., pythonpath=PIL_QWEN2VL_PATH, env=PIL_QWEN2VL_ENV)``.
PIL_QWEN2VL_PATH = [REPLICAS.parent / "e2e" / "site"]
PIL_QWEN2VL_ENV = {"DRAMA3_E2E_PIL_QWEN2VL": "1"}


def omni_npu_runners(version: str | None = None) -> Path:
    """The folder of NPU runner stand-ins for ``version`` (default: the installed vllm-omni)."""
    version = version or installed("vllm-omni")
    if version not in OMNI_NPU_RUNNERS:
        raise LookupError(f"no NPU runner stand-ins for vllm-omni {version!r}; have {sorted(OMNI_NPU_RUNNERS)}")
    return profile(OMNI_NPU_RUNNERS[version]) / NPU_WORKER_PACKAGE.replace(".", "/")


def cpu_imports() -> None:
    """Off CUDA, tell diffusers that flashinfer is absent, as it would be on a host without it:
    flashinfer 0.7 (a vLLM dependency) reads CUDA device properties at import, and diffusers
    imports it whenever it is installed; vllm_omni.worker_v2 reaches diffusers."""
    import torch

    if not torch.cuda.is_available():
        import diffusers.utils.import_utils as diffusers_imports

        diffusers_imports._flashinfer_available = False


def enter_npu_workers(version: str | None = None) -> None:
    """In a child or a forked test, first: the real vllm-omni NPU worker package, with the runner
    stand-ins for ``version`` found before the published runner modules (which need vLLM-Ascend
    internals)."""
    import importlib

    cpu_imports()
    importlib.import_module(NPU_WORKER_PACKAGE).__path__.insert(0, str(omni_npu_runners(version)))


def npu_env(**extra: str) -> dict[str, str]:
    """Environment of a child that applies the patches as on an Ascend host."""
    env = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "npu"}
    env.update(extra)
    return env


#: A real Ascend host's child (tests marked ``npu``): the engine on and strict, the platform
#: detected, not told.
ASCEND_HOST_ENV = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_STRICT": "1"}


def apply_checked(patch_id: str):
    """``patch_id`` applied to what is imported (the environment already enables the engine) and
    checked ``applied``; returns the ``drama3_patches`` module."""
    import drama3_patches

    drama3_patches.apply([patch_id])
    row = {p["id"]: p for p in drama3_patches.status()["patches"]}[patch_id]
    assert row["state"] == "applied", row
    return drama3_patches


def apply_on_npu(monkeypatch, patch_id: str):
    """Forked tests: the engine on as on an Ascend host (strict, platform npu), then
    :func:`apply_checked`."""
    for name, value in npu_env(DRAMA3_PATCHES_STRICT="1").items():
        monkeypatch.setenv(name, value)
    return apply_checked(patch_id)


def _forget_versions() -> None:
    # Installed versions are looked up once per process (drama3_patches.versions); a fork
    # inherits what its parent saw before the stand-ins went on sys.path.
    import importlib

    from drama3_patches import versions

    importlib.invalidate_caches()
    versions.clear_cache()


def prepend_profiles(*names: str) -> None:
    """Forked tests: the profiles first on sys.path, for the rest of the process."""
    sys.path[:0] = [str(p) for p in profile_paths(*names)]
    _forget_versions()


@contextlib.contextmanager
def on_sys_path(*names: str):
    """Put profiles first on this process's sys.path; restore sys.path and forget the modules
    imported from them on exit. Prefer a forked test (``@pytest.mark.forked``) for anything that
    patches real classes."""
    roots = [str(p) for p in profile_paths(*names)]
    saved = list(sys.path)
    before = set(sys.modules)
    sys.path[:0] = roots
    _forget_versions()
    try:
        yield roots
    finally:
        sys.path[:] = saved
        _forget_versions()
        for name in set(sys.modules) - before:
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if any(origin.startswith(root) for root in roots):
                del sys.modules[name]

