"""The block-FP8 format both expansion kernels implement: the scale grid and the definition.

A leaf (torch only): :mod:`.fp8` (the expansion and its kernel choice) and :mod:`.fp8_native`
(the C kernel, self-checked against :func:`reference_dequant`) both import it, and
``fp8`` imports ``fp8_native``, never the other way.
"""

from __future__ import annotations

import torch

BLOCK = (128, 128)


def expected_scale_shape(weight_shape, block_size=BLOCK) -> tuple[int, int]:
    """Shape of ``weight_scale_inv`` for an ``(N, K)`` weight: one scale per block, edges included."""
    n, k = weight_shape
    bn, bk = block_size
    return (-(-n // bn), -(-k // bk))


def reference_dequant(weight: torch.Tensor, scale: torch.Tensor, block_size=BLOCK) -> torch.Tensor:
    """The definition: ``(w.float() * scale_expanded).to(torch.bfloat16)`` (slow, memory hungry)."""
    n, k = weight.shape
    bn, bk = block_size
    expanded = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.float() * expanded).to(torch.bfloat16)
