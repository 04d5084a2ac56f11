"""Eager kernels against vLLM's torch-native references, side by side in one run.

    python benchmarks/eager_kernels.py            # default set, about a minute on 2 cores
    python benchmarks/eager_kernels.py --repeat 7 --threads 4

Each row times the reference and ours alternately (interleaved, so machine
noise hits both) and prints the medians and ``ratio = reference / ours``
(above 1: ours is faster).  Shapes are those Drama 3 uses: batch 1-64, the
151,936-entry text vocabulary, 4,096-entry codebooks, head dim 256 with
partial rotary 64.

References (vLLM): sampling = ``apply_top_k_top_p_pytorch`` + float32 softmax +
``random_sample`` (the v1 sampler's ``forward_native``); "topk-first" = a plain
filter that takes ``topk(k)``, masks the full vocabulary, then does the same
softmax and exponential race (the first thing one writes; the issue measured
it at ~20x); norms = ``GemmaRMSNorm.forward_native``; RoPE =
``RotaryEmbedding.forward_native``; QK = the eager ``_project_qkv_gate``
composition of those.
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


def _row(name, ref_name, ref_ms, ours_ms, target=None):
    ratio = ref_ms / ours_ms
    verdict = "" if target is None else ("  ok" if ratio >= target else f"  BELOW TARGET {target}x")
    print(f"{name:<44} {ref_name:<14} {ref_ms:9.2f} ms  ours {ours_ms:8.2f} ms  ratio {ratio:6.2f}x{verdict}")
    return ratio


def _topk_first(logits, k, p):
    from vllm.v1.sample.ops.topk_topp_sampler import random_sample

    kmax = int(k.max())
    vals, ids = logits.topk(kmax, dim=-1)
    vals = vals.masked_fill(torch.arange(kmax) >= k.unsqueeze(1), float("-inf"))
    probs = vals.softmax(-1)
    asc = probs.flip(-1).cumsum(-1).flip(-1)
    keep = asc > (1 - p).unsqueeze(1)
    keep[:, 0] = True
    full = torch.full_like(logits, float("-inf")).scatter_(1, ids, vals.masked_fill(~keep, float("-inf")))
    return random_sample(full.softmax(-1, dtype=torch.float32), {})


def bench_sampling(repeat):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch, random_sample

    from drama3_patches.kernels.sampling import sample_top_k_top_p

    def reference(logits, k, p):
        filtered = apply_top_k_top_p_pytorch(logits.clone(), k, p)
        return random_sample(filtered.softmax(-1, dtype=torch.float32), {})

    gen = torch.Generator().manual_seed(0)
    print("\n== sampling (float32 logits; vLLM's sampler upcasts before filtering)")
    out = {}
    for batch, vocab, k, p, shape in [
        (64, 151936, 30, 0.9, "flat"),
        (1, 151936, 30, 0.9, "flat"),
        (64, 4096, 30, 0.9, "flat"),
        (64, 151936, None, 0.9, "flat"),
        (64, 151936, None, 0.9, "peaked"),
    ]:
        g = torch.Generator().manual_seed(batch)
        logits = torch.randn(batch, vocab, generator=g) * 3
        if shape == "peaked":  # a language-model-like head: a few hundred plausible tokens
            logits[:, torch.randperm(vocab, generator=g)[:300]] += 10
        kt = None if k is None else torch.full((batch,), k)
        pt = torch.full((batch,), p)
        label = f"B={batch} V={vocab} k={k} p={p} {shape}"
        r, o = _time_pair(lambda: reference(logits, kt, pt),
                          lambda: sample_top_k_top_p(logits, kt, pt, generator=gen), repeat)
        target = 10 if (batch, vocab, k) == (64, 151936, 30) else (1 if k is None else None)
        out[label] = _row(label, "full-sort", r, o, target)
        if k is not None:
            r2, o2 = _time_pair(lambda: _topk_first(logits, kt, pt),
                                lambda: sample_top_k_top_p(logits, kt, pt, generator=gen), repeat)
            _row("  same, vs a plain top-k-first filter", "topk-first", r2, o2, 1)
    return out


def bench_norms(repeat):
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    from drama3_patches.kernels.norms import gemma_rms_norm
    from drama3_patches.kernels.qk_norm_rope_gate import qk_norm_rope_gate
    from drama3_patches.kernels.rope import apply_rope

    print("\n== norms, RoPE, QK-norm+RoPE+gate (bfloat16 activations)")
    dtype = torch.bfloat16
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        norm = GemmaRMSNorm(2048, eps=1e-6).to(dtype)
        qn = GemmaRMSNorm(256, eps=1e-6).to(dtype)
        kn = GemmaRMSNorm(256, eps=1e-6).to(dtype)
        rope = RotaryEmbedding(256, 64, 32768, 10000.0, True, dtype)
    for tokens in (64, 2048):
        x = torch.randn(tokens, 2048).to(dtype)
        res = torch.randn(tokens, 2048).to(dtype)
        r, o = _time_pair(lambda: norm.forward_native(x), lambda: gemma_rms_norm(x, norm.weight, 1e-6), repeat)
        _row(f"gemma_rms_norm T={tokens} H=2048", "GemmaRMSNorm", r, o, 1)
        r, o = _time_pair(lambda: norm.forward_native(x, res),
                          lambda: gemma_rms_norm(x, norm.weight, 1e-6, res), repeat)
        _row(f"gemma_rms_norm+residual T={tokens} H=2048", "GemmaRMSNorm", r, o, 1)

        heads, kv_heads = 16, 2
        pos = torch.randint(0, 32768, (tokens,))
        q = torch.randn(tokens, heads * 256).to(dtype)
        k = torch.randn(tokens, kv_heads * 256).to(dtype)
        r, o = _time_pair(lambda: rope.forward_native(pos, q, k),
                          lambda: apply_rope(pos, q, k, rope.cos_sin_cache, 256, 64), repeat)
        _row(f"rope T={tokens} 16q/2kv heads d=256 rot=64", "RotaryEmb", r, o, 1)

        qkv = torch.randn(tokens, 2 * heads * 256 + 2 * kv_heads * 256).to(dtype)

        def eager():
            q_gate, kk, v = qkv.split([2 * heads * 256, kv_heads * 256, kv_heads * 256], dim=-1)
            qq, gate = torch.chunk(q_gate.view(tokens, heads, 512), 2, dim=-1)
            qq, gate = qq.reshape(tokens, -1), gate.reshape(tokens, -1)
            qq = qn.forward_native(qq.view(-1, heads, 256)).view(-1, heads * 256)
            kk = kn.forward_native(kk.view(-1, kv_heads, 256)).view(-1, kv_heads * 256)
            return rope.forward_native(pos, qq, kk), v, gate

        r, o = _time_pair(eager, lambda: qk_norm_rope_gate(
            qkv, pos, qn.weight, kn.weight, rope.cos_sin_cache, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=256, rotary_dim=64, eps=1e-6), repeat)
        _row(f"qk_norm_rope_gate T={tokens}", "eager split", r, o, 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per kernel (median reported)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a shared host, waiting OpenMP "
                         "workers slow every small op and blur the ratios)")
    ap.add_argument("--only", choices=["sampling", "norms"], default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, repeat {args.repeat}")
    with torch.inference_mode():
        if args.only in (None, "sampling"):
            bench_sampling(args.repeat)
        if args.only in (None, "norms"):
            bench_norms(args.repeat)


if __name__ == "__main__":
    main()
