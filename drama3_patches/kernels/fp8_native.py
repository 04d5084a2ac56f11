"""A small C kernel for the block-FP8 -> bfloat16 expansion, built on first use.

Why C: the torch-op path needs a dozen passes over every element (and a join of
torch's threads after each small op); one fused pass reads each fp8 byte once
and writes each bfloat16 once, which is what the memory bound allows.

Why plain C through ``ctypes`` rather than a torch extension: it includes no
torch headers (builds in about a second with the system C compiler, no ABI
coupling to the installed torch) and ``ctypes`` releases the GIL for the call.
The source is ``fp8_expand.c`` (package data); :mod:`.fp8_build` compiles and caches it,
this module loads, checks and calls it.

How it computes (one scale ``s`` per 128x128 block):

* The definition, per element, is ``bf16(float32(code) * s)`` with the
  float32 product rounded once and the bfloat16 rounded to nearest even;
  ``expand_one`` below computes exactly that, and gives NaN results the bits
  torch's own contiguous float32 -> bfloat16 conversion gives NaN (probed at
  load time).
* Where ``|s|`` lies in ``[2**-120, 2**118]`` every product of a normal code is
  a normal float32 and a finite normal bfloat16, and both roundings commute
  with a power-of-two factor.  The result for a normal code (exponent e >= 1,
  mantissa f) is then the result for ``e = 1`` with ``e - 1`` added to the
  bfloat16 exponent field.  So a 16-entry table per block (the 8 subnormal
  codes and the 8 mantissas at ``e = 1``, computed by ``expand_one``), an
  integer add of ``e << 7`` and the code's sign bit give every result; the
  lookup is a byte shuffle (``pshufb``), 32 codes per step with AVX2, 16 with
  SSE4.1.  The two NaN codes are blended in.  Blocks whose scale is outside
  that range (zero, tiny, huge, inf, NaN), and builds without those
  instructions, use a 256-entry table of ``expand_one``.
* ``(N, K)`` output streams rows.  Transposed ``(K, N)`` output works in units
  of 128 source columns by 512 source rows: the codes are transposed in 8x8
  blocks (in registers) into a per-worker buffer, then each output row segment
  is converted; the strided output writes are what limits this layout.
* ``threads`` workers (pthreads) take units from one shared atomic counter, so
  a worker that the OS deschedules delays only the unit it holds; they meet
  once, at the end of the call.  Workers are capped so that their buffers stay
  within ``N*K`` bytes (half of one bfloat16 expert).

Everything is checked against :func:`drama3_patches.kernels.fp8_format.reference_dequant`
right after loading (all 256 codes, scale extremes, both layouts); a mismatch
disables this kernel with a warning and the torch-op path is used.

Environment: ``DRAMA3_PATCHES_FP8_KERNEL=auto|native|torch`` (see
``drama3_patches.kernels.fp8``); the build's (cache folder, compiler) are in :mod:`.fp8_build`.
Imports: :mod:`.fp8_format` and :mod:`.fp8_build`; :mod:`.fp8` imports this module, never the reverse.
"""

from __future__ import annotations

import ctypes
import os
import threading

# Imported here, not inside the build: a fork while another thread is importing them
# would leave the child waiting on (or crashing in) a half-done import.
import torch

from drama3_patches.kernels import fp8_build
from drama3_patches.kernels.fp8_format import expected_scale_shape, reference_dequant
from drama3_patches.logger import init_logger

logger = init_logger(__name__)

__all__ = ["available", "expand", "load", "unavailable_reason"]

_LOCK = threading.Lock()
_STATE: dict = {}  # "lib", "nan_bits", "reason", "path"


def _new_lock_in_child() -> None:
    # A fork while another thread builds would leave the child's copy of the lock held forever.
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def _open(path) -> ctypes.CDLL:
    """Load a library file (a path, or a checked :class:`.fp8_build.Library`) and declare its functions."""
    lib = ctypes.CDLL(path.load_path() if isinstance(path, fp8_build.Library) else str(path))
    i64 = ctypes.c_int64
    fn = lib.d3_fp8_expand
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, i64, i64, i64, ctypes.c_void_p, i64, i64, ctypes.c_void_p, i64, i64, i64,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.d3_fp8_simd_level.restype = ctypes.c_int
    return lib


def _open_checked(extra_flags: tuple[str, ...] = ()):
    """Find or build, check and load; a cached library that does not load (truncated) is rebuilt once."""
    lib = fp8_build.find_or_build(extra_flags, None, rebuild=False)
    try:
        try:
            return _open(lib), lib.path
        except (OSError, AttributeError) as exc:  # not a loadable object, or a symbol missing
            logger.warning("fp8 expansion: the cached kernel %s does not load (%s); building it again",
                           lib.path, exc)
    finally:
        lib.close()
    lib = fp8_build.find_or_build(extra_flags, None, rebuild=True)
    try:
        return _open(lib), lib.path
    finally:
        lib.close()


def torch_nan_bits() -> int | None:
    """The bfloat16 bits torch's contiguous float32 -> bfloat16 conversion gives NaN (None if not one value)."""
    pats = torch.tensor([0x7FC00000, -0x400000, 0x7F800001, -1, 0x7FFFFFFF, 0x7FA00000], dtype=torch.int64)
    seen = set()
    for n in (1, 7, 33, 257):
        for p in pats.tolist():
            t = torch.full((n,), p, dtype=torch.int64).to(torch.int32).view(torch.float32)
            seen.update((t.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF).tolist())
    return seen.pop() if len(seen) == 1 else None


def _self_check(lib, nan_bits: int) -> str | None:
    """Compare with the definition on all codes, scale extremes and both layouts; a reason on mismatch."""
    g = torch.Generator().manual_seed(0)
    for n, k in ((130, 300), (256, 256), (7, 129)):
        codes = torch.randint(0, 256, (n * k,), dtype=torch.uint8, generator=g)
        codes[:256] = torch.arange(256, dtype=torch.uint8)
        w = codes.view(n, k).view(torch.float8_e4m3fn)
        for mag in (1e-2, -3.0, 1e-37, 2.0 ** 119, 0.0):
            s = torch.rand(expected_scale_shape((n, k)), generator=g) * mag + mag / 8
            if s.numel() > 2:
                s.view(-1)[1] = float("inf")
                s.view(-1)[2] = float("nan")
            ref = reference_dequant(w, s)
            for transposed in (False, True):
                out = torch.empty((k, n) if transposed else (n, k), dtype=torch.bfloat16)
                _call(lib, w.view(torch.uint8), s, out, transposed, (128, 128), 2, nan_bits)
                want = ref.t().contiguous() if transposed else ref
                if not torch.equal(out.view(torch.int16), want.view(torch.int16)):
                    return f"self-check mismatch (shape {(n, k)}, scale {mag}, transposed={transposed})"
    return None


def _call(lib, codes, scale32, out, transposed: bool, block_size, threads: int, nan_bits: int) -> int:
    """One C call; returns how many threads worked (the kernel caps them to bound its scratch)."""
    n, k = codes.shape
    used = lib.d3_fp8_expand(codes.data_ptr(), n, k, codes.stride(0), scale32.data_ptr(), scale32.stride(0),
                      scale32.stride(1), out.data_ptr(), out.stride(0), int(block_size[0]), int(block_size[1]),
                      int(transposed), nan_bits, max(1, int(threads)))
    if used < 1:
        raise MemoryError("fp8 native kernel: no scratch memory for a worker")
    return used


def load():
    """The loaded, self-checked library, or None (the reason is in :func:`unavailable_reason`)."""
    if "lib" in _STATE:
        return _STATE["lib"]
    with _LOCK:
        if "lib" in _STATE:
            return _STATE["lib"]
        lib, reason = None, None
        try:
            nan_bits = torch_nan_bits()
            if nan_bits is None:
                reason = "torch's float32 -> bfloat16 conversion gives NaN more than one encoding"
            else:
                candidate, path = _open_checked()
                reason = _self_check(candidate, nan_bits)
                if reason is None:
                    lib = candidate
                    _STATE.update(nan_bits=nan_bits, path=path, simd=candidate.d3_fp8_simd_level())
        except Exception as exc:  # no compiler, build error, unwritable cache: the torch path still works
            reason = f"{type(exc).__name__}: {exc}"
        if lib is None:
            logger.warning("fp8 expansion: native kernel unavailable (%s); using the torch-op path", reason)
        _STATE["reason"] = reason
        _STATE["lib"] = lib
        return lib


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    load()
    return _STATE.get("reason")


def info() -> dict:
    """What was loaded: library path, SIMD level (2 AVX2, 1 SSE4.1, 0 scalar table), NaN bits."""
    load()
    return {k: _STATE.get(k) for k in ("path", "simd", "nan_bits", "reason")}


def expand(codes, scale32, out, *, transposed: bool, block_size, threads: int) -> int:
    """``out`` <- expansion of ``codes`` (2-D uint8 view of the fp8 weight, unit column stride).

    ``scale32`` is a 2-D float32 CPU tensor, ``out`` a CPU bfloat16 tensor of shape ``(k, n)``
    (transposed) or ``(n, k)`` with unit column stride.  Callers check shapes.  Returns the
    number of threads that worked.
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"fp8 native kernel unavailable: {_STATE.get('reason')}")
    return _call(lib, codes, scale32, out, transposed, block_size, threads, _STATE["nan_bits"])
