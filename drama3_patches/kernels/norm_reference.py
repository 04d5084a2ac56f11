"""The eager Gemma row norm in float32: the definition both ``norms`` (the kernels) and
``npu_fused`` (the fused ops' self-check) hold their results to. A leaf: torch only, so neither
of them imports the other for it."""

from __future__ import annotations

import torch

__all__ = ["gemma_rows_f32"]


def gemma_rows_f32(x32: torch.Tensor, weight: torch.Tensor, eps: float, beta: float = 1.0) -> torch.Tensor:
    """Normalise float32 rows ``[..., D]`` with ``weight + beta`` (Gemma: 1); a new float32 tensor
    (``x32`` may be the caller's)."""
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    out = x32 * torch.rsqrt(variance + eps)
    return out.mul_(weight.to(torch.float32) + beta)
