"""Per-rank slices of attention weights, and a digest of sampled frames.

Plain torch, no process group: the caller passes the tensor-parallel size and rank.

* :func:`head_split` says which query and key/value heads a rank holds. Query heads are
  split evenly; key/value heads too when there are at least as many as ranks, otherwise
  each is replicated on ``tp_size // num_kv_heads`` consecutive ranks (the rank's query
  heads then all read that one head, as grouped-query attention wants).
* :func:`qkv_gate_rows` cuts a rank's rows out of a ``[q | gate | k | v]`` projection
  (rows ordered head by head inside each part), keeping that order with local counts.
* :func:`output_columns` cuts a rank's input columns out of the output projection.
* :func:`frames_digest` folds an integer frame tensor into two int64 sums that cannot
  overflow for ids below 2**20, so equal frames give equal digests on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HeadSplit", "frames_digest", "head_split", "output_columns", "qkv_gate_rows"]


@dataclass(frozen=True)
class HeadSplit:
    tp_size: int
    tp_rank: int
    num_heads: int  # local query (and gate) heads
    num_kv_heads: int  # local key/value heads
    head_start: int  # first global query head of this rank
    kv_head_start: int  # first global key/value head of this rank


def head_split(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadSplit:
    """The heads ``tp_rank`` of ``tp_size`` holds; ValueError when the counts do not split."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"rank {tp_rank} is outside a group of {tp_size}")
    if num_heads % tp_size:
        raise ValueError(f"{num_heads} query heads do not split over {tp_size} ranks")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} key/value heads do not split over {tp_size} ranks")
        local_kv, kv_start = num_kv_heads // tp_size, tp_rank * (num_kv_heads // tp_size)
    else:
        if tp_size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} key/value heads cannot be replicated evenly over {tp_size} ranks")
        local_kv, kv_start = 1, tp_rank // (tp_size // num_kv_heads)
    local = num_heads // tp_size
    return HeadSplit(tp_size, tp_rank, local, local_kv, tp_rank * local, kv_start)


def qkv_gate_rows(weight: torch.Tensor, total_heads: int, total_kv_heads: int, head_dim: int,
                  split: HeadSplit) -> torch.Tensor:
    """The rank's ``[q | gate | k | v]`` rows of a full projection (a new contiguous tensor)."""
    q_size, kv_size = total_heads * head_dim, total_kv_heads * head_dim
    if weight.shape[0] != 2 * q_size + 2 * kv_size:
        raise ValueError(f"projection has {weight.shape[0]} rows; {total_heads} heads and {total_kv_heads} "
                         f"key/value heads of {head_dim} need {2 * q_size + 2 * kv_size}")
    q, gate, k, v = weight.split([q_size, q_size, kv_size, kv_size], dim=0)
    heads = slice(split.head_start * head_dim, (split.head_start + split.num_heads) * head_dim)
    kv = slice(split.kv_head_start * head_dim, (split.kv_head_start + split.num_kv_heads) * head_dim)
    return torch.cat((q[heads], gate[heads], k[kv], v[kv]), dim=0).contiguous()


def output_columns(weight: torch.Tensor, head_dim: int, split: HeadSplit) -> torch.Tensor:
    """The rank's input columns of an output projection ``[out, heads * head_dim]``."""
    start = split.head_start * head_dim
    return weight[:, start:start + split.num_heads * head_dim].contiguous()


def frames_digest(frames: torch.Tensor) -> torch.Tensor:
    """``[2]`` int64 digest of an integer tensor (shape folded in), computed where it lives.

    Two weighted sums with different position weights below 2**16: with values below
    2**20 and fewer than 2**26 elements no partial sum leaves int64.
    """
    flat = frames.reshape(-1).to(torch.int64) + 1
    index = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64)
    first = (flat * (index % 65521 + 1)).sum()
    second = (flat * ((index * 7919) % 65519 + 1)).sum()
    shape = torch.tensor(sum(d << (8 * i) for i, d in enumerate(frames.shape[-2:])), device=flat.device)
    return torch.stack((first + shape, second))
