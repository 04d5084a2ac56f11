"""The eager kernels of tower-sampler-eager against straightforward references, side by side.

    python benchmarks/eager_kernels.py            # default set, about a minute on 2 cores
    python benchmarks/eager_kernels.py --repeat 7 --threads 4

Each row times the reference and ours alternately (interleaved, so machine
noise hits both) and prints the medians and ``ratio = reference / ours``
(above 1: ours is faster).  Shapes are Drama 3's: batch 1-64, the
151,936-entry text vocabulary and 4,096-entry codebooks for the draws, tower
width 2048, 16 query / 2 KV heads of 256 with partial rotary 64.

References:

* ``draw_top_k_top_p``: the same semantics written the obvious way (softmax
  over the full row, a full descending sort, cumulative sum, keep, exponential
  race on the same noise).  The row also says whether both drew the same
  tokens.  DESIGN.md's "10x a full-sort reference at batch 64 over 150k, k=30,
  p=0.9" was set for the old vLLM-semantics sampler; it is shown for scale.
* norms: vLLM's ``GemmaRMSNorm.forward_native``, with the embedding lookup,
  mask, extra add and concatenation around it as the eager tower did before
  fish_omni's fused kernels.
* ``sigmoid_gate``: vLLM's attention gate expression ``x * torch.sigmoid(g)``
  (in the activation dtype; ours is float32 inside, as the kernel is).
* ``fused_qk_rmsnorm_rope_gate``: vLLM's eager branch of
  ``Qwen3NextAttention._project_qkv_gate`` (split, ``GemmaRMSNorm`` per head,
  ``RotaryEmbedding.forward_native``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _time_pair(ref, ours, repeat):
    ref(), ours()  # warm-up
    t_ref, t_ours = [], []
    for _ in range(repeat):
        s = time.perf_counter(); ref(); t_ref.append(time.perf_counter() - s)
        s = time.perf_counter(); ours(); t_ours.append(time.perf_counter() - s)
    return statistics.median(t_ref) * 1e3, statistics.median(t_ours) * 1e3


def _row(name, ref_name, ref_ms, ours_ms, note=""):
    ratio = ref_ms / ours_ms
    print(f"{name:<46} {ref_name:<13} {ref_ms:9.2f} ms  ours {ours_ms:8.2f} ms  ratio {ratio:6.2f}x{note}")
    return ratio


def full_sort_draw(logits, temperature, top_k, top_p, uniform, max_top_k, id_map=None):
    """draw_top_k_top_p's semantics, straightforwardly: every probability, one full sort."""
    t = temperature.float().clamp_min(1e-5).unsqueeze(1)
    probs = (logits.float() / t).softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1])
    keep = (sorted_probs.cumsum(dim=-1) <= top_p.unsqueeze(1)) & (ranks < top_k.clamp(max=max_top_k).unsqueeze(1))
    keep[:, 0] = True
    race = torch.full_like(sorted_probs, float("inf"))
    race[:, :max_top_k] = -uniform[:, :max_top_k].clamp_min(1e-30).log()
    score = torch.where(keep, sorted_probs / race, -1.0)
    token = order.gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)
    return token if id_map is None else id_map[token]


def bench_draw(repeat):
    from drama3_patches.kernels.sampling import draw_top_k_top_p

    print("\n== draw_top_k_top_p (float32 logits, max_top_k 64)")
    for batch, vocab, k, p in [(64, 151936, 30, 0.9), (1, 151936, 30, 0.9), (64, 4096, 30, 0.9),
                               (64, 4096, 64, 1.0)]:
        g = torch.Generator().manual_seed(batch + vocab)
        logits = torch.randn(batch, vocab, generator=g) * 3
        temperature = torch.full((batch,), 0.8)
        kt, pt = torch.full((batch,), k), torch.full((batch,), p)
        uniform = torch.rand(batch, 64, generator=g)
        same = torch.equal(full_sort_draw(logits, temperature, kt, pt, uniform, 64),
                           draw_top_k_top_p(logits, temperature, kt, pt, uniform, 64))
        r, o = _time_pair(lambda: full_sort_draw(logits, temperature, kt, pt, uniform, 64),
                          lambda: draw_top_k_top_p(logits, temperature, kt, pt, uniform, 64), repeat)
        _row(f"B={batch} V={vocab} k={k} p={p}", "full sort", r, o, f"  same tokens: {same}")


def bench_norms(repeat):
    import torch.nn.functional as F
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    from drama3_patches.kernels.gating import sigmoid_gate
    from drama3_patches.kernels.norms import gemma_rms_norm, gemma_rms_norm_table, tower_mix_norm
    from drama3_patches.kernels.qk_norm_rope_gate import fused_qk_rmsnorm_rope_gate

    print("\n== tower norms, gate, fused QK norm + RoPE + gate (bfloat16 activations, width 2048)")
    dtype, dim, codes = torch.bfloat16, 2048, 4096
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        norm, enorm = GemmaRMSNorm(dim, eps=1e-6).to(dtype), GemmaRMSNorm(dim, eps=1e-6).to(dtype)
        qn, kn = GemmaRMSNorm(256, eps=1e-6).to(dtype), GemmaRMSNorm(256, eps=1e-6).to(dtype)
        rope = RotaryEmbedding(256, 64, 32768, 10000.0, True, dtype)
    g = torch.Generator().manual_seed(0)
    table = torch.randn(codes, dim, generator=g).to(dtype)
    for tokens in (64, 2048):
        x = torch.randn(tokens, dim, generator=g).to(dtype)
        res = torch.randn(tokens, dim, generator=g).to(dtype)
        code = torch.randint(0, codes, (tokens,), generator=g)
        mask = torch.rand(tokens, generator=g) > 0.2
        r, o = _time_pair(lambda: norm.forward_native(x), lambda: gemma_rms_norm(x, norm.weight, 1e-6), repeat)
        _row(f"gemma_rms_norm T={tokens}", "GemmaRMSNorm", r, o)
        r, o = _time_pair(lambda: norm.forward_native(x, res),
                          lambda: gemma_rms_norm(x, norm.weight, 1e-6, res), repeat)
        _row(f"gemma_rms_norm+residual T={tokens}", "GemmaRMSNorm", r, o)

        def table_reference():
            added = F.embedding(code, table) * mask.unsqueeze(1).to(dtype)
            return norm.forward_native(x, added)

        r, o = _time_pair(table_reference,
                          lambda: gemma_rms_norm_table(x, code, mask, table, norm.weight, 1e-6), repeat)
        _row(f"gemma_rms_norm_table T={tokens}", "lookup+norm", r, o)

        def mix_reference():
            emb = F.embedding(code, table) * mask.unsqueeze(1).to(dtype) + res
            return torch.cat((enorm.forward_native(emb), norm.forward_native(x)), dim=-1)

        r, o = _time_pair(mix_reference, lambda: tower_mix_norm(
            x, code, mask, table, res, enorm.weight, norm.weight, 1e-6), repeat)
        _row(f"tower_mix_norm+extra T={tokens}", "lookup+2 norms", r, o)

        heads, kv_heads = 16, 2
        attn, gate = (torch.randn(tokens, heads * 256, generator=g).to(dtype) for _ in range(2))
        r, o = _time_pair(lambda: attn * torch.sigmoid(gate), lambda: sigmoid_gate(attn, gate), repeat)
        _row(f"sigmoid_gate T={tokens} 16x256", "x*sigmoid(g)", r, o)

        pos = torch.randint(0, 32768, (tokens,), generator=g)
        qkv = torch.randn(tokens, 2 * heads * 256 + 2 * kv_heads * 256, generator=g).to(dtype)

        def vllm_eager_branch():
            q_gate, kk, v = qkv.split([2 * heads * 256, kv_heads * 256, kv_heads * 256], dim=-1)
            qq, gg = torch.chunk(q_gate.view(tokens, heads, 512), 2, dim=-1)
            qq, gg = qq.reshape(tokens, -1), gg.reshape(tokens, -1)
            qq = qn.forward_native(qq.view(-1, heads, 256)).view(-1, heads * 256)
            kk = kn.forward_native(kk.view(-1, kv_heads, 256)).view(-1, kv_heads * 256)
            return rope.forward_native(pos, qq, kk), v, gg

        def fused_eager():
            q_gate, kk, _ = qkv.split([2 * heads * 256, kv_heads * 256, kv_heads * 256], dim=-1)
            return fused_qk_rmsnorm_rope_gate(q_gate, kk, qn.weight, kn.weight, rope.cos_sin_cache, pos, 1e-6,
                                              heads, kv_heads, 256, 64, norm_beta=1.0)

        r, o = _time_pair(vllm_eager_branch, fused_eager, repeat)
        _row(f"fused_qk_rmsnorm_rope_gate T={tokens}", "vLLM eager", r, o)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per kernel (median reported)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a shared host, waiting OpenMP "
                         "workers slow every small op and blur the ratios)")
    ap.add_argument("--only", choices=["draw", "norms"], default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, repeat {args.repeat}")
    with torch.inference_mode():
        if args.only in (None, "draw"):
            bench_draw(args.repeat)
        if args.only in (None, "norms"):
            bench_norms(args.repeat)


if __name__ == "__main__":
    main()
