"""Sigmoid output gating, ``x * sigmoid(gate)``."""

from __future__ import annotations

import torch

__all__ = ["sigmoid_gate"]


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Return ``x * sigmoid(gate)``.

    Shapes: ``gate`` broadcasts to ``x``.  Dtype: the result has ``x.dtype``;
    the sigmoid and the product are evaluated in the inputs' dtype, exactly as
    vLLM's attention forward does (``attn_output * torch.sigmoid(gate)``), so
    the two agree bit for bit.  Inputs are not modified.
    """
    out = torch.sigmoid(gate)
    return out.mul_(x) if out.dtype == x.dtype and out.shape == x.shape else x * out
