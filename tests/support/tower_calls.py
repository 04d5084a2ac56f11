"""The eager kernels' calls in one decode frame of Drama 3's codebook tower and frame sampler.

Shapes are the published config's (``drama3_patches.tools.tiny_model.DRAMA3_DECODER``: width 2048, 16 query /
2 KV heads of 256, rotary 64, 4,096 codes, 10 codebooks, 4 shared + 9 per-codebook layers) with
the argument kinds vLLM-Omni 0.32.0rc1's ``fish_omni`` passes (``codebook_tower.py``,
``sampling.py``, ``fish_omni_model.py``): bfloat16 activations and norm weights, ``q_gate`` and
``k`` as column slices of the qkv projection, int64 codes with a bool mask, the float32 rotary
cache, bfloat16 logits over 4,096 candidates, float32 noise sliced from ``[rows, 11, 64]``.

At decode every request contributes one token row, so ``batch`` rows go through every call.
"""

from __future__ import annotations

import torch

from drama3_patches.tools.tiny_model import DRAMA3_DECODER

__all__ = ["CALLS_PER_FRAME", "tower_calls"]

# Per frame: 13 tower layers (1 with tower_mix_norm, 12 with the code table), each one fused QK,
# one sigmoid gate and three norms (hnorm or input norm without residual, two with it); 11 draws
# (first and RAS semantic draws over shared candidates, then one per codebook head 1..9).
_LAYERS = DRAMA3_DECODER["shared_enrichment_layers"] + DRAMA3_DECODER["num_codebooks"] - 1
_DRAWS = 2 + DRAMA3_DECODER["num_codebooks"] - 1
CALLS_PER_FRAME = {
    "fused_qk_rmsnorm_rope_gate": _LAYERS,
    "gemma_rms_norm": _LAYERS,
    "gemma_rms_norm+residual": 2 * _LAYERS,
    "gemma_rms_norm_table": _LAYERS - 1,
    "tower_mix_norm": 1,
    "sigmoid_gate": _LAYERS,
    "draw_top_k_top_p+shared_top": 2,
    "draw_top_k_top_p": _DRAWS - 2,
}


def tower_calls(batch: int, seed: int = 0, dtype=torch.bfloat16, device=None) -> dict:
    """``{name: (kernel, args, kwargs)}`` for each entry of ``CALLS_PER_FRAME`` at ``batch`` rows.

    ``device``: the same values, drawn on the CPU and moved there (``q_gate`` and ``k`` stay
    column slices of one qkv tensor on it).
    """
    from drama3_patches.kernels import gating, norms, sampling
    from drama3_patches.kernels.qk_norm_rope_gate import fused_qk_rmsnorm_rope_gate

    d = DRAMA3_DECODER
    dim, heads, kv, head_dim, codes = d["dim"], d["n_head"], d["n_local_heads"], d["head_dim"], d["vocab_size"]
    rotary, max_top_k, eps = head_dim // 4, 64, 1e-6
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    x, res, extra = randn(batch, dim), randn(batch, dim), randn(batch, dim)
    w, w2 = randn(dim, scale=0.3), randn(dim, scale=0.3)
    table = randn(codes, dim)
    code = torch.randint(0, codes, (batch,), generator=g)
    mask = torch.rand(batch, generator=g) > 0.2
    qkv = randn(batch, 2 * heads * head_dim + 2 * kv * head_dim, scale=2.0)
    hw, kw = randn(head_dim, scale=0.3), randn(head_dim, scale=0.3)
    cache = torch.randn(4096, rotary, generator=g)
    pos = torch.randint(0, 4096, (batch,), generator=g)
    attn, gate = randn(batch, heads * head_dim), randn(batch, heads * head_dim)
    logits = randn(batch, codes, scale=3.0)
    temperature = torch.rand(batch, generator=g) + 0.3
    top_k = torch.randint(1, 80, (batch,), generator=g)
    top_p = torch.rand(batch, generator=g) * 0.9 + 0.1
    noise = torch.rand(batch, _DRAWS, max_top_k, generator=g)
    candidate_ids = torch.randperm(codes, generator=g) + 248000
    if device is not None:
        (x, res, extra, w, w2, table, code, mask, qkv, hw, kw, cache, pos, attn, gate, logits, temperature, top_k,
         top_p, noise, candidate_ids) = (t.to(device) for t in (
            x, res, extra, w, w2, table, code, mask, qkv, hw, kw, cache, pos, attn, gate, logits, temperature,
            top_k, top_p, noise, candidate_ids))
    q_gate, k = qkv[:, : 2 * heads * head_dim], qkv[:, 2 * heads * head_dim: (2 * heads + kv) * head_dim]
    top = torch.topk(logits, max_top_k, dim=-1)
    return {
        "fused_qk_rmsnorm_rope_gate": (fused_qk_rmsnorm_rope_gate,
                                       (q_gate, k, hw, kw, cache, pos, eps, heads, kv, head_dim, rotary),
                                       {"norm_beta": 1.0}),
        "gemma_rms_norm": (norms.gemma_rms_norm, (x, w, eps), {}),
        "gemma_rms_norm+residual": (norms.gemma_rms_norm, (x, w, eps), {"residual": res}),
        "gemma_rms_norm_table": (norms.gemma_rms_norm_table, (x, code, mask, table, w, eps), {}),
        "tower_mix_norm": (norms.tower_mix_norm, (x, code, mask, table, extra, w, w2, eps), {}),
        "sigmoid_gate": (gating.sigmoid_gate, (attn, gate), {}),
        "draw_top_k_top_p+shared_top": (sampling.draw_top_k_top_p,
                                        (logits, temperature, top_k, top_p, noise[:, 0], max_top_k,
                                         candidate_ids, top), {}),
        "draw_top_k_top_p": (sampling.draw_top_k_top_p,
                             (logits, temperature, top_k, top_p, noise[:, 3], max_top_k), {}),
    }
