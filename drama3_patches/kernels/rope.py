"""Rotary position embedding (NeoX or GPT-J layout, partial rotary dimension).

Numerics follow vLLM's ``RotaryEmbedding.forward_native``: the cached
``[cos | sin]`` rows are cast to the query dtype and the rotation is evaluated
in that dtype, so results are bit-identical to it.  Unlike the reference, the
rotation is written into one output buffer instead of chunk/cat copies.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rotate"]


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    is_neox_style: bool = True,
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of each head, copy the rest.

    ``x`` is ``[T, heads, head_dim]``; ``cos``/``sin`` are ``[T, rotary_dim//2]``
    already in ``x.dtype``.  Returns a new ``[T, heads, head_dim]`` tensor.
    """
    half = rotary_dim // 2
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    if is_neox_style:
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
    else:
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    if torch.compiler.is_compiling() or (
            torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad)):
        # Autograd cannot record out= arguments, nor Dynamo trace strided ones: same arithmetic,
        # out of place.
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if is_neox_style:
            rot = torch.cat((o1, o2), dim=-1)
        else:
            rot = torch.stack((o1, o2), dim=-1).flatten(-2)
        return torch.cat((rot, x[..., rotary_dim:]), dim=-1)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if is_neox_style:
        o1, o2 = out[..., :half], out[..., half:rotary_dim]
    else:
        o1, o2 = out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2]
    # o1 = x1*cos - x2*sin ; o2 = x2*cos + x1*sin, same op order as the reference
    torch.mul(x1, cos, out=o1)
    o1.sub_(x2 * sin)
    torch.mul(x2, cos, out=o2)
    o2.add_(x1 * sin)
    if rotary_dim < x.shape[-1]:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    return out


def apply_rope(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply rotary embedding to ``query`` and ``key``.

    Shapes: ``positions`` has ``T`` elements (any shape, flattened);
    ``query``/``key`` are ``[T, heads * head_size]`` (or ``[T, heads,
    head_size]``); ``cos_sin_cache`` is ``[max_position, rotary_dim]`` holding
    ``[cos | sin]`` halves.  ``rotary_dim`` must be even and ``<= head_size``;
    channels past it pass through unchanged.

    Dtypes: the rotation runs in the query dtype (cos/sin are cast to it), the
    same as vLLM's native path.  Returns new tensors shaped like the inputs;
    ``key`` may be None.
    """
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos_sin = cos_sin_cache.index_select(0, positions).to(query.dtype)
    cos, sin = cos_sin.chunk(2, dim=-1)
    q = rotate(_heads(query, num_tokens, head_size), cos, sin, rotary_dim, is_neox_style)
    q = q.view(query.shape)
    if key is None:
        return q, None
    k = rotate(_heads(key, num_tokens, head_size), cos, sin, rotary_dim, is_neox_style)
    return q, k.view(key.shape)


def _heads(x: torch.Tensor, num_tokens: int, head_size: int) -> torch.Tensor:
    # Explicit head count: a `-1` view is ambiguous for an empty batch.
    return x.view(num_tokens, x.shape[-1] // head_size if x.dim() == 2 else x.shape[-2], head_size)
