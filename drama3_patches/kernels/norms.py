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
"""

from __future__ import annotations

import torch

__all__ = ["gemma_rms_norm", "gemma_rows_f32", "gemma_rms_norm_table", "tower_mix_norm"]


def gemma_rows_f32(x32: torch.Tensor, weight: torch.Tensor, eps: float, beta: float = 1.0) -> torch.Tensor:
    """Normalise float32 rows ``[..., D]`` with ``weight + beta`` (Gemma: 1); a new float32 tensor
    (``x32`` may be the caller's)."""
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    out = x32 * torch.rsqrt(variance + eps)
    return out.mul_(weight.to(torch.float32) + beta)


def _code_rows(code: torch.Tensor, code_mask: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table[clamp(code)] * mask`` in float32, ``[rows, D]``.

    Codes outside the table are clamped to its first/last row (the published
    kernel does the same instead of faulting); the mask multiplies, so a masked
    row is exactly zero.
    """
    index = code.reshape(-1).clamp(0, table.shape[0] - 1)
    rows = table.index_select(0, index).to(torch.float32)
    return rows.mul_(code_mask.reshape(-1, 1).to(torch.float32))


def gemma_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x / rms(x) * (1 + weight)``; with ``residual``: ``(norm(x + r), x + r)``.

    ``x`` is ``[..., D]`` (the published kernel takes ``[rows, D]``);
    ``weight`` ``[D]`` of any float dtype; ``residual`` shaped like ``x``.
    Results are new tensors in ``x.dtype``; inputs are not modified.
    """
    x32 = x.to(torch.float32)
    if residual is None:
        return gemma_rows_f32(x32, weight, eps).to(x.dtype)
    x32 = x32 + residual.to(torch.float32)
    return gemma_rows_f32(x32, weight, eps).to(x.dtype), x32.to(x.dtype)


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
    s32 = x.to(torch.float32) + _code_rows(code, code_mask, table)
    return gemma_rows_f32(s32, weight, eps).to(x.dtype), s32.to(x.dtype)


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
    emb = _code_rows(code, code_mask, table).to(dtype)
    if extra is not None:
        # in-place float32 add: extra's elements are promoted on the fly, no extra buffer
        emb = emb.to(torch.float32).add_(extra).to(dtype)
    out = torch.empty((rows, 2 * dim), dtype=dtype, device=hidden.device)
    out[:, :dim] = gemma_rows_f32(emb.to(torch.float32), enorm_weight, eps)
    out[:, dim:] = gemma_rows_f32(hidden.to(torch.float32), hnorm_weight, eps)
    return out
