"""torch-npu's fused RMSNorm ops for the eager tower kernels, behind feature detection and a self-check.

Off CUDA every aten op is one host dispatch (10-40 us on Ascend), and the tower's norms
dominate a decode frame in eager mode. Where the tensors live on an NPU and ``torch_npu``
provides ``npu_rms_norm`` and ``npu_add_rms_norm``, ``norms`` and ``qk_norm_rope_gate`` hand
each row normalisation to one of them instead of six to eight aten ops.

:func:`fused_norms` answers None (the eager path) for every other device, for a ``torch_npu``
without both ops, and when ``DRAMA3_PATCHES_NPU_FUSED`` is set off (docs/design.md). It never
imports ``torch_npu``: a tensor on a real NPU means the process has imported it already, and
a tensor on anything else must not start the Ascend runtime. The fused ops round ``gamma`` to
the activation dtype and keep their own rounding order, so they agree with the eager path to
bfloat16 tolerance, not bit for bit; the CPU path never reaches them.

Having the ops is not trusted: :func:`for_tensor` hands them out for rows of a dtype only once
they have proven themselves on the device, once per process, device type and dtype, at the first
call that would take them (on a server, vLLM's profile run). Each op runs on a small probe there;
its result must have torch-npu's documented arity (``(y, rstd)``; ``(y, rstd, x_sum)``), ``y``
and ``x_sum`` the input's shape, dtype and device, ``y`` within :func:`tolerance` of the eager
gemma norm (``gamma = 1 + w``; a few ulps of the dtype, :data:`ULPS`) and ``x_sum`` exactly
``x + residual``. The probe tells the contract's likely look-alikes apart: its rows have a mean
far from zero (a LayerNorm misses), its heads different scales (a norm over the whole row
instead of each head misses) and one row a mean square under eps (another eps misses). A difference or an
exception gives one warning naming the op and what differed, and rows of that dtype keep the
eager path for the rest of the process. The verdict is cached, so a call after it costs what a
call cost before. Under torch.compile tracing no probe can run (its tensors are symbolic): a
traced call takes the ops only where an eager call proved them earlier in the process.
"""

from __future__ import annotations

import math
import sys

import torch

from drama3_patches import env
from drama3_patches.logger import init_logger

from .norm_reference import gemma_rows_f32

logger = init_logger(__name__)

__all__ = ["FUSED_DTYPES", "ULPS", "FusedNorms", "for_tensor", "fused_norms", "probe", "tolerance"]

#: activation dtypes both fused ops take (torch-npu documents float16, bfloat16 and float32)
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: how far ``y`` may be from the eager norm, in machine epsilons of its dtype relative to each value
#: (2 to 4 ulps in bfloat16 and float16: both paths round the float32 product once; float32 sums
#: the squares in another order and may approximate the reciprocal square root). A zero stays zero.
ULPS = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 16}
_OPS = ("npu_rms_norm", "npu_add_rms_norm")
# device type -> FusedNorms or None, found once per process (torch_npu's ops and the opt-out do not change)
_BACKENDS: dict = {}
_EPS = 1e-6
_ROWS, _HEADS, _WIDTH = 4, 2, 256  # the probe: four rows, as the QK path passes heads [rows, heads, D]


class FusedNorms:
    """Two fused row norms over ``gamma``'s trailing shape (``[D]``: each row of ``D``).

    ``rms_norm(x, gamma, eps) -> y`` and ``add_rms_norm(x, residual, gamma, eps) -> (y, x + residual)``,
    with ``y = s * rsqrt(mean(s^2) + eps) * gamma``. Built on ops shaped like torch-npu's
    (``(y, rstd)`` and ``(y, rstd, x_sum)``), which :meth:`proven` checks before the kernels use
    them; the tests build one on stand-in ops of that shape.
    """

    __slots__ = ("_rms_norm", "_add_rms_norm", "_verdicts")

    def __init__(self, rms_norm_op, add_rms_norm_op) -> None:
        self._rms_norm = rms_norm_op
        self._add_rms_norm = add_rms_norm_op
        self._verdicts: dict = {}  # (device type, dtype) -> whether the self-check passed

    def rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(_dense(x), gamma, eps)[0]

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float):
        y, _, x_sum = self._add_rms_norm(_dense(x), _dense(residual), gamma, eps)
        return y, x_sum

    def proven(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether both ops passed the self-check for ``dtype`` rows on ``device``'s type; the
        first ask runs it on ``device`` (one warning if it fails), later ones read the verdict."""
        key = (device.type, dtype)
        verdict = self._verdicts.get(key)
        if verdict is None:
            if torch.compiler.is_compiling():
                return False  # nothing to run a probe on while tracing; not a verdict
            verdict = self._verdicts[key] = _self_check(self, device, dtype)
        return verdict


def _dense(x: torch.Tensor) -> torch.Tensor:
    # The fused ops are documented on dense rows; a strided view (q heads inside [q | gate],
    # a column slice of qkv) is copied first. Dense input is passed as it is, with no launch.
    return x.contiguous()


def fused_norms(device) -> FusedNorms | None:
    """The fused norms found for tensors on ``device`` (a ``torch.device``), or None for the eager
    path; not yet proven for any dtype (:func:`for_tensor` asks)."""
    kind = device.type
    if kind != "npu":
        return None
    try:
        return _BACKENDS[kind]
    except KeyError:
        # the opt-out is read with the ops, once: the kernels run every layer of every frame
        found = _BACKENDS[kind] = _detect() if env.npu_fused() else None
        return found


def _detect() -> FusedNorms | None:
    # Only a torch_npu the process imported itself: an "npu" device without it (a simulated one)
    # has no fused ops, and importing it here could start a runtime nobody asked for.
    module = sys.modules.get("torch_npu")
    ops = [getattr(module, name, None) for name in _OPS]
    if module is None or not all(callable(op) for op in ops):
        return None
    return FusedNorms(*ops)


def for_tensor(x: torch.Tensor) -> FusedNorms | None:
    """:func:`fused_norms` for ``x``'s device where they have proven themselves for ``x``'s dtype
    (one of those the fused ops take), else None."""
    if x.dtype not in FUSED_DTYPES:
        return None
    fused = fused_norms(x.device)
    if fused is None or not fused.proven(x.device, x.dtype):
        return None
    return fused


# -- the self-check ------------------------------------------------------------------------------


def tolerance(dtype: torch.dtype) -> float:
    """The self-check's bound on ``|y - eager| / |eager|`` for ``dtype`` rows."""
    return ULPS[dtype] * torch.finfo(dtype).eps


def _grid(shape: tuple, step: int, offset: int) -> torch.Tensor:
    # Exact in every fused dtype, as are the sums of two (so x_sum has one right answer):
    # - values (k + 48) / 16 with |k| <= 64: each row's mean is far from zero, so a LayerNorm
    #   (mean subtracted) misses by the order of the values themselves;
    # - row i scaled by 2^(i - 1), rows of different pattern: a result taken from the wrong row
    #   misses; row 0 is small instead ((j - 4) / 2^14, |j - 4| <= 12, normal in float16): its mean
    #   square (~1.5e-7) is under eps, so an op with another eps misses it by a factor;
    # - in a [rows, heads, D] probe, head h scaled by 4^h: normalising the whole row instead of
    #   each head misses every head by a factor.
    idx = torch.arange(math.prod(shape)) * step + offset
    k = (idx % 129 - 64 + 48).to(torch.float32).view(shape) / 16
    scale = torch.exp2(torch.arange(shape[0], dtype=torch.float32) - 1).view(-1, *([1] * (len(shape) - 1)))
    x = k * scale
    x[0] = ((idx % 17 - 4).to(torch.float32).view(shape) / 2 ** 14)[0]
    if len(shape) == 3:
        x = x * torch.exp2(2 * torch.arange(shape[1], dtype=torch.float32)).view(1, -1, 1)
    return x


def probe(dtype: torch.dtype) -> tuple[dict, dict]:
    """The self-check's host inputs in ``dtype`` and what the eager gemma norm makes of them:
    ``({"x3", "x2", "residual", "weight"}, {"rms_norm": y of x3, "add_rms_norm": (y, x_sum) of
    x2 + residual})``, eps 1e-6. ``weight`` is ``j / 64`` (``|j| <= 32``): ``1 + weight`` is exact too.
    """
    inputs = {"x3": _grid((_ROWS, _HEADS, _WIDTH), 37, 11).to(dtype),
              "x2": _grid((_ROWS, _WIDTH), 53, 7).to(dtype),
              "residual": _grid((_ROWS, _WIDTH), 41, 90).to(dtype),
              "weight": (((torch.arange(_WIDTH) * 29 + 3) % 65 - 32) / 64).to(dtype)}
    s32 = inputs["x2"].to(torch.float32) + inputs["residual"].to(torch.float32)
    wants = {"rms_norm": gemma_rows_f32(inputs["x3"].to(torch.float32), inputs["weight"], _EPS).to(dtype),
             "add_rms_norm": (gemma_rows_f32(s32, inputs["weight"], _EPS).to(dtype), s32.to(dtype))}
    return inputs, wants


def _self_check(fused: FusedNorms, device: torch.device, dtype: torch.dtype) -> bool:
    """Run both ops on the probe on ``device``; True if they match, else one warning and False."""
    try:
        with torch.no_grad():
            problems = _problems(fused, device, dtype)
    except Exception as exc:  # the probe's own copies failed: nothing about the ops is known
        problems = [f"the self-check could not run ({_brief(exc)})"]
    name = str(dtype).removeprefix("torch.")
    if problems:
        logger.warning("fused norms: the self-check on %s with %s rows failed: %s; the tower's %s norms keep the "
                       "eager torch path (DRAMA3_PATCHES_NPU_FUSED=0 skips the fused ops and this check)",
                       device.type, name, "; ".join(problems), name)
        return False
    logger.info("fused norms: %s passed their self-check on %s with %s rows", " and ".join(_OPS), device.type, name)
    return True


def _problems(fused: FusedNorms, device: torch.device, dtype: torch.dtype) -> list[str]:
    inputs, wants = probe(dtype)
    on = {k: v.to(device) for k, v in inputs.items()}
    gamma = (on["weight"].to(torch.float32) + 1.0).to(dtype)  # as norms.fused_gamma rounds it
    problems = []
    for op, call, want, outputs in (
            (_OPS[0], lambda: fused._rms_norm(on["x3"], gamma, _EPS), (wants["rms_norm"],), ("y", "rstd")),
            (_OPS[1], lambda: fused._add_rms_norm(on["x2"], on["residual"], gamma, _EPS), wants["add_rms_norm"],
             ("y", "rstd", "x_sum"))):
        try:
            result = call()
        except Exception as exc:
            problems.append(f"{op} raised {_brief(exc)}")
            continue
        problem = _result_problem(op, result, outputs, want, device)
        if problem:
            problems.append(problem)
    return problems


def _result_problem(op: str, result, outputs: tuple, want: tuple, device: torch.device) -> str | None:
    """What is wrong with ``result`` (arity, then y's and x_sum's shape, dtype, device, values)."""
    if not isinstance(result, (tuple, list)) or len(result) != len(outputs):
        return f"{op} returned {_describe(result)}, expected a tuple of {len(outputs)} ({', '.join(outputs)})"
    # y first, x_sum last; rstd (unused by the kernels) is not examined
    checked = (("y", result[0], want[0], False),) + ((("x_sum", result[2], want[1], True),) if len(want) > 1 else ())
    for name, got, expected, exact in checked:
        if not isinstance(got, torch.Tensor):
            return f"{op}'s {name} is {_describe(got)}, expected a tensor"
        if got.shape != expected.shape or got.dtype != expected.dtype or got.device.type != device.type:
            return (f"{op}'s {name} is {_describe(got)} on {got.device.type}, expected "
                    f"{_describe(expected)} on {device.type}")
        deviation = _deviation(got.cpu(), expected, exact)
        if deviation:
            return f"{op}'s {name} {deviation}"
    return None


def _deviation(got: torch.Tensor, want: torch.Tensor, exact: bool) -> str | None:
    g, w = got.to(torch.float32), want.to(torch.float32)
    off = (g - w).abs()
    if exact:
        if bool((off == 0).all()):
            return None
        return f"differs from x + residual by up to {off.max().item():.4g} (expected exactly)"
    bound = tolerance(got.dtype) * w.abs()
    if bool((off <= bound).all()):  # NaN fails; a zero must stay zero
        return None
    worst = (off / w.abs().clamp_min(torch.finfo(torch.float32).tiny)).max().item()
    return (f"differs from the eager gemma norm by up to {off.max().item():.4g} (relative {worst:.3g}; "
            f"tolerance {tolerance(got.dtype):.3g} of each value, {ULPS[got.dtype]} x "
            f"{str(got.dtype).removeprefix('torch.')} eps)")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _brief(exc: BaseException) -> str:
    # device errors run to many lines (an error code, then a stack from the runtime): the first, bounded
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:200]}"
