"""Sigmoid output gating: the eager counterpart of ``fish_omni.kernels.sigmoid_gate``."""

from __future__ import annotations

import torch

__all__ = ["sigmoid_gate"]


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` evaluated in float32, rounded once to ``x.dtype``.

    ``gate`` has ``x``'s number of elements (the published kernel pairs them
    element by element in memory order; here in logical order, the same for
    the contiguous tensors it is given).  A new tensor shaped like ``x``.
    """
    g32 = gate.reshape(x.shape).to(torch.float32)
    return torch.sigmoid(g32).mul_(x.to(torch.float32)).to(x.dtype)
