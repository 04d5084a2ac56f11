"""Gemma (zero-centred) RMSNorm and the Drama 3 tower's fused norm entry points.

Eager counterparts of vllm-omni's ``fish_omni.kernels`` ``gemma_rms_norm``,
``gemma_rms_norm_table`` and ``tower_mix_norm`` (same names, parameters and
results), written for any torch device.

Numerics, shared by all three: the row statistics, the ``1 + weight`` scale
and the products are float32; a row is ``x * rsqrt(mean(x^2) + eps) * (w + 1)``
in that order; a residual sum is formed in float32, returned rounded to the
activation dtype, and the norm is taken of the unrounded float32 sum.  Where
the published kernel rounds an intermediate to the output dtype (the tower's
code embedding), so does this code.

``gemma_rms_norm`` also serves ``qk_norm_rope_gate`` (vLLM's eager QK path),
where it agrees bit for bit with ``GemmaRMSNorm.forward_native``.

Host dispatch: every aten op is a device launch off CUDA, so the code keeps them few
while computing exactly the same float32 values (results are bit-identical to the plain
form ``x.to(float32)`` ... ``.to(dtype)``):

* float32 ``weight + beta`` is prepared once per weight (``prepared``) and reused;
* lower-precision operands are promoted inside a float32 op instead of cast first
  (``pow`` with a one-element float32 exponent squares exactly: checked on every finite
  bfloat16 and float16 value; ``addcmul(a, b, one)`` is ``a + b`` in float32);
* the last product is written with ``out=`` straight into the low-precision result.

On an NPU with torch-npu's fused norms (``npu_fused``; never on CPU) each row normalisation is
one fused op instead, with ``1 + weight`` rounded once to the activation dtype
(``fused_gamma``): the same formula to bfloat16 tolerance, not bit for bit.
"""

from __future__ import annotations

import functools
import weakref

import torch

from . import npu_fused
from .norm_reference import gemma_rows_f32

__all__ = ["gemma_rms_norm", "gemma_rows_f32", "gemma_rms_norm_table", "tower_mix_norm", "prepared", "constant", "into",
           "fused_gamma"]

_LOW = (torch.bfloat16, torch.float16)
_F32 = torch.float32
_PREPARED: dict = {}
_CONSTANTS: dict = {}


def _evict(key, ref) -> None:
    entry = _PREPARED.get(key)
    if entry is not None and ref in entry[0]:
        del _PREPARED[key]


def prepared(tag, sources: tuple, make):
    """``make()`` once per ``(tag, sources)``, reused while every source tensor is the same
    object with the same storage and version counter; the entry goes with its sources.

    In-place changes made through ``param.data`` bypass the parameter's version counter:
    weights are final before the first forward (fish_omni permutes them at load). Inference
    tensors (no version counter), weights that autograd follows and traced code compute it
    each time.
    """
    if (torch.compiler.is_compiling() or any(t.is_inference() for t in sources)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in sources))):
        return make()
    key = (tag, *(id(t) for t in sources))
    stamp = tuple((t.data_ptr(), t._version) for t in sources)
    entry = _PREPARED.get(key)
    if entry is not None and entry[1] == stamp and all(r() is t for r, t in zip(entry[0], sources)):
        return entry[2]
    value = make()
    refs = tuple(weakref.ref(t, functools.partial(_evict, key)) for t in sources)
    _PREPARED[key] = (refs, stamp, value)
    return value


def constant(value: float, device) -> torch.Tensor:
    """A one-element float32 tensor on ``device``, made once (a 1-D operand promotes a bfloat16 op
    to float32, where a 0-D one would not)."""
    if torch.compiler.is_compiling():
        return torch.full((1,), value, dtype=_F32, device=device)
    key = (value, torch.device(device))
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.full((1,), value, dtype=_F32, device=device)
    return t


def into(out: torch.Tensor, op, *args) -> torch.Tensor:
    """``op(*args, out=out)``; where autograd records a graph or Dynamo traces one (neither takes a
    strided ``out=``), the same values through a copy."""
    if torch.compiler.is_compiling():
        return out.copy_(op(*args))
    flat = [t for a in args for t in (a if isinstance(a, (tuple, list)) else (a,))]
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
        return out.copy_(op(*args))
    return op(*args, out=out)


def weight_f32(weight: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """``weight.to(float32) + beta``, prepared once per weight."""
    return prepared(("w", beta), (weight,), lambda: weight.to(_F32) + beta)


def fused_gamma(weight: torch.Tensor, dtype, beta: float = 1.0) -> torch.Tensor:
    """``weight + beta`` formed in float32 and rounded once to ``dtype`` (the fused ops take gamma
    in the activation dtype), prepared once per weight."""
    return prepared(("gamma", beta, dtype), (weight,), lambda: (weight.to(_F32) + beta).to(dtype))


def _square(x: torch.Tensor) -> torch.Tensor:
    # float32 squares of float32 / bfloat16 / float16 rows, without a separate cast
    if x.dtype in _LOW:
        return torch.pow(x, constant(2.0, x.device))
    return x.pow(2)


def normalize_into(
    x: torch.Tensor, w32: torch.Tensor, eps: float, out: torch.Tensor, own: bool = False
) -> torch.Tensor:
    """``out = x * rsqrt(mean(x^2) + eps) * w32`` in float32, rounded once into ``out``.

    ``x`` float32, bfloat16 or float16 ``[..., D]``; ``own``: ``x`` is a float32 scratch of the
    caller's, overwritten.
    """
    scale = _square(x).mean(dim=-1, keepdim=True).add_(eps).rsqrt_()
    rows = x.mul_(scale) if own and not x.requires_grad else torch.mul(x, scale)
    return into(out, torch.mul, rows, w32)


def _f32_operand(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in _LOW or x.dtype == _F32 else x.to(_F32)


def gemma_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x / rms(x) * (1 + weight)``; with ``residual``: ``(norm(x + r), x + r)``.

    ``x`` is ``[..., D]`` (the published kernel takes ``[rows, D]``);
    ``weight`` ``[D]`` of any float dtype; ``residual`` shaped like ``x``.
    Results are new tensors in ``x.dtype``; inputs are not modified.
    """
    fused = npu_fused.for_tensor(x)
    if fused is not None and (residual is None or residual.dtype == x.dtype):
        return _fused_gemma(fused, x, weight, eps, residual)
    w32 = weight_f32(weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        return normalize_into(_f32_operand(x), w32, eps, out)
    # x + r in float32 (the products with one are exact, so no fused rounding can differ)
    s32 = torch.addcmul(_f32_operand(x), _f32_operand(residual), constant(1.0, x.device))
    if x.dtype == _F32:
        return normalize_into(s32, w32, eps, out), s32
    summed = s32.to(x.dtype)
    return normalize_into(s32, w32, eps, out, own=True), summed


def _fused_gemma(fused, x, weight, eps, residual):
    # one fused op: the norm, or with a residual the sum (in x's dtype) and the norm of it
    gamma = fused_gamma(weight, x.dtype)
    if residual is None:
        return fused.rms_norm(x, gamma, eps)
    return fused.add_rms_norm(x, residual, gamma, eps)


def _table_rows(code, table) -> torch.Tensor:
    """``table[code]``, codes outside the table clamped to its first/last row (as the published
    kernel does instead of faulting)."""
    return table.index_select(0, code.reshape(-1).clamp(0, table.shape[0] - 1))


def _masked_rows(x, code, code_mask, table) -> torch.Tensor:
    """float32 ``x + code_mask * table[clamp(code)]`` ``[rows, D]`` (``x`` None: without it).

    Codes outside the table are clamped to its first/last row (the published
    kernel does the same instead of faulting); the mask multiplies, so a masked
    row is exactly zero.
    """
    rows = _table_rows(code, table)
    mask = code_mask.reshape(-1, 1)
    mask32 = mask.to(_F32)
    if x is None:
        return torch.mul(rows, mask32)
    if mask.dtype == torch.bool:
        # rows * {0, 1} is exact: one fused op gives the same float32 sum
        return torch.addcmul(_f32_operand(x), rows, mask32)
    return torch.mul(rows, mask32).add_(x)


def _masked_rows_as(dtype, code, code_mask, table) -> torch.Tensor:
    """``code_mask * table[clamp(code)]`` ``[rows, D]`` in ``dtype``, for the fused sum with ``x``.

    The mask is 0/1, so multiplying in ``dtype`` is exact: the rows the fused op adds are the
    ones the eager path adds in float32 (a bool mask multiplies without a cast).
    """
    rows = _table_rows(code, table)
    if rows.dtype != dtype:
        rows = rows.to(dtype)
    mask = code_mask.reshape(-1, 1)
    if mask.dtype != torch.bool:
        mask = mask.to(dtype)
    return torch.mul(rows, mask)


def gemma_rms_norm_table(
    x: torch.Tensor,
    code: torch.Tensor,
    code_mask: torch.Tensor,
    table: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + code_mask * table[code]``; returns ``(norm(s), s)`` in ``x.dtype``.

    ``x`` ``[rows, D]``; ``code`` and ``code_mask`` one entry per row; ``table``
    ``[codes, D]``.
    """
    fused = npu_fused.for_tensor(x)
    if fused is not None:
        rows = _masked_rows_as(x.dtype, code, code_mask, table)
        return fused.add_rms_norm(x, rows, fused_gamma(weight, x.dtype), eps)
    s32 = _masked_rows(x, code, code_mask, table)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    w32 = weight_f32(weight)
    if x.dtype == _F32:
        return normalize_into(s32, w32, eps, out), s32
    summed = s32.to(x.dtype)
    return normalize_into(s32, w32, eps, out, own=True), summed


def tower_mix_norm(
    hidden: torch.Tensor,
    code: torch.Tensor,
    code_mask: torch.Tensor,
    table: torch.Tensor,
    extra: torch.Tensor | None,
    enorm_weight: torch.Tensor,
    hnorm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """``cat(enorm(code_mask * table[code] (+ extra)), hnorm(hidden))``, ``[rows, 2 * D]``.

    The embedding is rounded to ``hidden.dtype`` before ``extra`` is added and
    again after, as the published kernel stores it; both norms then run in
    float32 and the result is ``hidden.dtype``.
    """
    rows, dim = hidden.shape
    dtype = hidden.dtype
    emb = _code_embedding(hidden, code, code_mask, table, extra)
    fused = npu_fused.for_tensor(hidden)
    if fused is not None:
        # one fused norm per half; the cat writes both into the [rows, 2 * D] result
        return torch.cat((fused.rms_norm(emb, fused_gamma(enorm_weight, dtype), eps),
                          fused.rms_norm(hidden, fused_gamma(hnorm_weight, dtype), eps)), dim=-1)
    out = torch.empty((rows, 2 * dim), dtype=dtype, device=hidden.device)
    normalize_into(_f32_operand(emb), weight_f32(enorm_weight), eps, out[:, :dim])
    normalize_into(_f32_operand(hidden), weight_f32(hnorm_weight), eps, out[:, dim:])
    return out


def _code_embedding(hidden, code, code_mask, table, extra) -> torch.Tensor:
    """``code_mask * table[code] (+ extra)`` in ``hidden.dtype``, rounded where the published
    kernel stores it: after the masked row, and again after adding ``extra``."""
    emb = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    into(emb, torch.mul, _table_rows(code, table), code_mask.reshape(-1, 1).to(_F32))
    if extra is not None:
        # float32 emb + extra, rounded again into emb (out= may be an input of the same elements)
        into(emb, torch.addcmul, emb, _f32_operand(extra), constant(1.0, hidden.device))
    return emb
