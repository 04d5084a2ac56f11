"""The QK RMSNorm + (partial) RoPE + gate split, with two numerics.

* :func:`fused_qk_rmsnorm_rope_gate`: the eager counterpart of vLLM's Triton
  ``vllm.model_executor.layers.fused_qk_norm_rope.fused_qk_rmsnorm_rope_gate``
  (same parameters, checks and results): the normalised head is rounded to the
  activation dtype, then rotated in float32 and rounded again.  Drama 3's
  codebook tower calls it directly, on every platform.
* :func:`qk_norm_rope_gate`: the eager branch of vLLM's
  ``Qwen3NextAttention._project_qkv_gate`` (split, ``GemmaRMSNorm`` native
  forward, then RoPE in the activation dtype), bit for bit; the reference the
  qwen3next-eager-attention tests compare the patched layer with.

The two differ by the rotation's precision (up to an ulp of the activation
dtype); neither is a stand-in for the other.

On an NPU with torch-npu's fused norms (``npu_fused``) both normalise with them (each head
group one fused op, gamma rounded to the activation dtype): to bfloat16 tolerance of the
eager numerics above, which every other device keeps bit for bit.
"""

from __future__ import annotations

import torch

from . import npu_fused
from .norms import fused_gamma, gemma_rms_norm, into, normalize_into, prepared
from .rope import apply_rope

__all__ = ["fused_qk_rmsnorm_rope_gate", "qk_norm_rope_gate"]


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


def fused_qk_rmsnorm_rope_gate(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    mrope_section: list[int] | tuple[int, int, int] | None = None,
    norm_beta: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``[q | gate]`` heads, RMS-normalise q and k per head, rotate, copy the gate.

    ``q_gate`` ``[T, num_q_heads * 2 * head_dim]`` (per head ``[q | gate]``) and
    ``k`` ``[T, num_kv_heads * head_dim]``, both float16 or both bfloat16;
    ``q_weight``/``k_weight`` ``[head_dim]``, applied as ``weight + norm_beta``;
    ``cos_sin_cache`` ``[max_pos, >= rotary_dim]`` holding ``[cos | sin]``;
    ``positions`` ``[T]``, or ``[3, T]`` with ``mrope_section`` (T/H/W counts
    summing to ``rotary_dim // 2``; rotary pair ``i`` takes the H position when
    ``i % 3 == 1 and i < 3 * h``, the W position when ``i % 3 == 2 and
    i < 3 * w``, else T).  NeoX halves over the first ``rotary_dim`` channels;
    the rest is normalised only.

    Returns new contiguous ``(q, k, gate)``: ``[T, heads * head_dim]`` in the
    input dtype (for one token, q and k are disjoint views of one new buffer);
    ``gate`` is the raw (pre-sigmoid) gate.  Invalid arguments
    raise ``ValueError`` under the same conditions as vLLM's kernel.
    """
    _check_fused_args(q_gate, k, q_weight, k_weight, cos_sin_cache, positions, rotary_dim, head_dim, mrope_section)
    tokens, dtype, device = q_gate.shape[0], q_gate.dtype, q_gate.device
    if tokens == 0:
        q_out = torch.empty((0, num_q_heads * head_dim), dtype=dtype, device=device)
        return q_out, torch.empty((0, num_kv_heads * head_dim), dtype=dtype, device=k.device), torch.empty_like(q_out)
    heads = q_gate.reshape(tokens, num_q_heads, 2, head_dim)
    k_heads = k.reshape(tokens, num_kv_heads, head_dim)
    fused = npu_fused.for_tensor(q_gate)
    if fused is None:
        normed = _normed_heads(heads[:, :, 0], k_heads, q_weight, k_weight, norm_beta, eps)
    else:
        # one fused op per head group (q and k have their own gamma), joined for the rotation
        q_normed = fused.rms_norm(heads[:, :, 0], fused_gamma(q_weight, dtype, norm_beta), eps)
        k_normed = fused.rms_norm(k_heads, fused_gamma(k_weight, dtype, norm_beta), eps)
        normed = torch.cat((q_normed, k_normed), dim=1)
    # NeoX rotation of the rounded heads in float32, rounded once more, in place:
    # [x1 | x2] * [cos | cos] + [x2 | x1] * [-sin | sin]  (x1*cos - x2*sin, x2*cos + x1*sin)
    cos2, signed_sin = _rotation(cos_sin_cache, positions, rotary_dim, mrope_section)
    rot = normed[..., :rotary_dim]
    swapped = rot.roll(rotary_dim // 2, dims=-1)
    into(rot, torch.add, torch.mul(rot, cos2), torch.mul(swapped, signed_sin))
    # contiguous() copies only when the rows interleave (more than one token)
    q_out = normed[:, :num_q_heads].reshape(tokens, num_q_heads * head_dim).contiguous()
    k_out = normed[:, num_q_heads:].reshape(tokens, num_kv_heads * head_dim).contiguous()
    gate_out = torch.empty((tokens, num_q_heads * head_dim), dtype=dtype, device=device)
    gate_out.view(tokens, num_q_heads, head_dim).copy_(heads[:, :, 1])
    return q_out, k_out, gate_out


def _normed_heads(q_heads, k_heads, q_weight, k_weight, beta, eps):
    """Eager: q and k heads ``[T, Hq + Hkv, D]`` normalised in float32, rounded once to their dtype."""
    tokens, num_q_heads, head_dim = q_heads.shape
    num_kv_heads = k_heads.shape[1]
    both = num_q_heads + num_kv_heads
    # One pass over the q and k heads together: [T, Hq + Hkv, D], copied to float32 by the cat.
    x32 = torch.empty((tokens, both, head_dim), dtype=torch.float32, device=q_heads.device)
    into(x32, torch.cat, (q_heads, k_heads), 1)
    normed = torch.empty((tokens, both, head_dim), dtype=q_heads.dtype, device=q_heads.device)
    weights = _head_weights(q_weight, k_weight, beta, num_q_heads, num_kv_heads)
    return normalize_into(x32, weights, eps, normed, own=True)


def _head_weights(q_weight, k_weight, beta, num_q_heads, num_kv_heads):
    """float32 ``w + beta`` per head ``[Hq + Hkv, D]``, prepared once per weight pair."""

    def make():
        q = (q_weight.to(torch.float32) + beta).expand(num_q_heads, -1)
        k = (k_weight.to(torch.float32) + beta).expand(num_kv_heads, -1)
        return torch.cat((q, k), dim=0)

    return prepared(("qk", beta, num_q_heads, num_kv_heads), (q_weight, k_weight), make)


def _rotation(cache, positions, rotary_dim, mrope_section):
    """float32 ``[cos | cos]`` and ``[-sin | sin]``, ``[T, 1, rotary_dim]`` each."""
    if positions.ndim == 1:
        half = rotary_dim // 2

        def make():
            cos = cache[:, :half].to(torch.float32)
            sin = cache[:, half:rotary_dim].to(torch.float32)
            return torch.cat((cos, cos, -sin, sin), dim=-1)

        # [max_pos, 2 * rotary_dim], prepared once per cache
        rows = prepared(("rope", rotary_dim), (cache,), make).index_select(0, positions).unsqueeze(1)
        return rows[..., :rotary_dim], rows[..., rotary_dim:]
    cos, sin = _cos_sin(cache, positions, rotary_dim, mrope_section)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def _check_fused_args(q_gate, k, q_weight, k_weight, cache, positions, rotary_dim, head_dim, mrope_section):
    # The fused kernel's own argument checks, so both paths refuse the same calls.
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_dim={rotary_dim} must be even, positive and at most head_dim={head_dim}")
    if q_gate.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q_gate.dtype:
        raise ValueError(f"q_gate and k need one float16/bfloat16 dtype, got {q_gate.dtype} and {k.dtype}")
    for name, tensor in (("q_gate", q_gate), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight),
                         ("cos_sin_cache", cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    if positions.ndim not in (1, 2):
        raise ValueError(f"positions must have 1 or 2 dimensions, got shape {tuple(positions.shape)}")
    if positions.shape[-1] != q_gate.shape[0]:
        raise ValueError(f"{positions.shape[-1]} positions for {q_gate.shape[0]} tokens")
    if positions.ndim == 1:
        if mrope_section is not None:
            raise ValueError("mrope_section needs [3, T] positions")
        return
    if positions.shape[0] != 3:
        raise ValueError(f"multimodal positions must be [3, T], got {tuple(positions.shape)}")
    if mrope_section is None or len(mrope_section) != 3:
        raise ValueError("multimodal positions need mrope_section with the T/H/W counts")
    if sum(mrope_section) != rotary_dim // 2:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to rotary_dim // 2 = {rotary_dim // 2}")


def _cos_sin(cache: torch.Tensor, positions: torch.Tensor, rotary_dim: int, mrope_section):
    """float32 ``cos``/``sin`` ``[T, 1, rotary_dim // 2]`` for each token (and rotary pair)."""
    half = rotary_dim // 2
    if positions.ndim == 1:
        rows = cache.index_select(0, positions.to(torch.int64))
        cos, sin = rows[:, :half], rows[:, half:rotary_dim]
    else:
        pair = torch.arange(half, device=positions.device)
        use_h = (pair % 3 == 1) & (pair < 3 * mrope_section[1])
        use_w = (pair % 3 == 2) & (pair < 3 * mrope_section[2])
        pos = positions.to(torch.int64).unsqueeze(-1)  # [3, T, 1]
        pos = torch.where(use_h, pos[1], torch.where(use_w, pos[2], pos[0]))  # [T, half]
        cos, sin = cache[pos, pair], cache[pos, pair + half]
    return cos.to(torch.float32).unsqueeze(1), sin.to(torch.float32).unsqueeze(1)
