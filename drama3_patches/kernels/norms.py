"""RMS normalisation kernels (plain and Gemma-style), with an optional fused
residual add, and the tower embedding lookup followed by a Gemma norm.

Numerics follow vLLM's torch-native ``rms_norm`` / ``fused_add_rms_norm``
(``vllm.ir.ops.layernorm``) operation for operation, so results are
bit-identical to ``RMSNorm.forward_native`` / ``GemmaRMSNorm.forward_native``
on the same device; the only change is fewer temporaries (in-place steps on
tensors this module allocated itself).
"""

from __future__ import annotations

import torch

__all__ = ["gemma_rms_norm", "rms_norm", "tower_embed_norm"]


def _normalise(x32: torch.Tensor, eps: float) -> torch.Tensor:
    # x32 may alias the caller's tensor (float32 input): never modify it in place.
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    return x32 * torch.rsqrt(variance + eps)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain RMSNorm: ``x / rms(x) * weight``.

    Shapes: ``x`` is ``[..., H]``; ``weight`` is ``[H]`` (any float dtype) or
    None; ``residual``, when given, has the shape of ``x``.

    Dtypes and accumulation: ``x`` (and ``residual``) are upcast to float32;
    the residual add, the mean of squares and the scaling happen in float32;
    the normalised value is cast to ``weight.dtype`` before the weight
    multiply (as vLLM's native op does), and the result is cast back to
    ``x.dtype``.

    Returns ``out`` or, with ``residual``, ``(out, new_residual)`` where
    ``new_residual = (x + residual)`` rounded to ``x.dtype``.  Inputs are not
    modified.
    """
    orig_dtype = x.dtype
    x32 = x.to(torch.float32)
    new_residual = None
    if residual is not None:
        x32 = x32 + residual.to(torch.float32)
        new_residual = x32.to(orig_dtype)
    out = _normalise(x32, eps)
    if weight is not None:
        if weight.dtype == torch.float32:
            out.mul_(weight)
        else:
            out = out.to(weight.dtype).mul_(weight)
    out = out.to(orig_dtype)
    return out if new_residual is None else (out, new_residual)


def gemma_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma-style RMSNorm: ``x / rms(x) * (1 + weight)``.

    Shapes: ``x`` is ``[..., H]``; ``weight`` is ``[H]`` (stored as the offset
    from 1, any float dtype); ``residual`` has the shape of ``x``.

    Dtypes and accumulation: ``1 + weight`` is formed in float32 and the whole
    computation (residual add, mean of squares, scaling, weight multiply) runs
    in float32; only the result is cast back to ``x.dtype``.

    Returns ``out`` or, with ``residual``, ``(out, new_residual)`` where
    ``new_residual = (x + residual)`` rounded to ``x.dtype``.  Inputs are not
    modified.
    """
    return rms_norm(x, weight.float() + 1.0, eps, residual)


def tower_embed_norm(
    ids: torch.Tensor,
    table: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    codebook_size: int | None = None,
) -> torch.Tensor:
    """Tower embedding lookup followed by a Gemma RMSNorm.

    ``ids`` is ``[N]`` (one id per row) or ``[N, C]`` with ``codebook_size``
    given: then codebook ``c`` is looked up at ``ids[:, c] + c * codebook_size``
    and the ``C`` embeddings are summed (in float32) before the norm.
    ``table`` is ``[rows, H]``; the result is ``[N, H]`` in ``table.dtype``.
    """
    if ids.dim() == 2 and codebook_size is not None:
        offsets = torch.arange(ids.shape[1], device=ids.device, dtype=ids.dtype)
        rows = ids + offsets * codebook_size
        emb = torch.nn.functional.embedding(rows, table).float().sum(dim=1)
        emb = emb.to(table.dtype)
    else:
        emb = torch.nn.functional.embedding(ids, table)
    return gemma_rms_norm(emb, norm_weight, eps)
