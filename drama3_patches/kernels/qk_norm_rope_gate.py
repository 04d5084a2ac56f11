"""Split the packed QKV(+gate) projection, Gemma-RMSNorm q and k per head,
apply (partial) NeoX rotary embedding: the eager counterpart of vLLM's
``fused_qk_rmsnorm_rope_gate`` Triton kernel.

Numerics are those of the eager branch of vLLM's
``Qwen3NextAttention._project_qkv_gate`` (split, ``GemmaRMSNorm`` native
forward in float32 with one rounding to the activation dtype, then RoPE in the
activation dtype), so the two agree bit for bit.
"""

from __future__ import annotations

import torch

from .norms import gemma_rms_norm
from .rope import apply_rope

__all__ = ["qk_norm_rope_gate"]


def qk_norm_rope_gate(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    eps: float,
    attn_output_gate: bool = True,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Return post-norm, post-RoPE ``(q, k, v)`` and the pre-sigmoid ``gate``.

    ``qkv`` is ``[T, W]`` laid out as ``[q_gate | k | v]`` where, with the
    gate, ``q_gate`` is ``[T, num_heads, 2 * head_dim]`` per head ``[q | gate]``
    (``W = num_heads*2*head_dim + 2*num_kv_heads*head_dim``); without it ``q`` is
    ``[T, num_heads * head_dim]``.  ``positions`` is ``[T]`` (a ``[3, T]``
    multimodal tensor uses its first row, as the fused kernel does for plain
    RoPE).  ``q_weight``/``k_weight`` are ``[head_dim]`` Gemma offsets
    (applied as ``1 + w``); ``cos_sin_cache`` is ``[max_pos, rotary_dim]``.

    Returns ``q`` ``[T, num_heads*head_dim]``, ``k`` ``[T, num_kv_heads*head_dim]``
    (new contiguous tensors in ``qkv.dtype``), ``v`` (a view of ``qkv``) and
    ``gate`` ``[T, num_heads*head_dim]`` (a contiguous copy) or None.

    Float32 accumulation: the RMS statistics and the ``1 + w`` scaling; the
    rotation runs in ``qkv.dtype`` like vLLM's native RoPE.
    """
    num_tokens = qkv.shape[0]
    q_size = num_heads * head_dim
    kv_size = num_kv_heads * head_dim
    if positions.dim() == 2:
        positions = positions[0]
    if attn_output_gate:
        q_gate, k, v = qkv.split([2 * q_size, kv_size, kv_size], dim=-1)
        q_gate = q_gate.view(num_tokens, num_heads, 2 * head_dim)
        q = q_gate[..., :head_dim]
        gate = q_gate[..., head_dim:].reshape(num_tokens, q_size)
    else:
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, num_heads, head_dim)
        gate = None
    q = gemma_rms_norm(q, q_weight, eps)
    k = gemma_rms_norm(k.view(num_tokens, num_kv_heads, head_dim), k_weight, eps)
    q, k = apply_rope(positions, q, k, cos_sin_cache, head_dim, rotary_dim, is_neox_style)
    return q.view(num_tokens, q_size), k.reshape(num_tokens, kv_size), v, gate
