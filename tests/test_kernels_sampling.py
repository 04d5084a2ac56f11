"""Top-k / top-p filtering and sampling against vLLM's v1 sampler.

Reference (vLLM 0.31 / 0.32, tier 2): ``apply_top_k_top_p_pytorch`` from
``vllm.v1.sample.ops.topk_topp_sampler`` (the full-sort path that
``apply_top_k_top_p`` takes without Triton), and ``softmax`` of its masked
logits for the filtered distribution.

Tolerance table:

=====================  ===================  ==============================================
quantity               tolerance            why
=====================  ===================  ==============================================
top-k kept ids         identical, all       top-k compares values only; ties at the
                       dtypes               boundary are all kept by both
top-p kept ids         identical, except a  the reference decides with a float32 cumsum
                       token whose exact    (error ~1e-8 here); a token that close to the
                       (float64) mass       boundary is a tie in all but the last bit.
                       before it is within  Logits in bfloat16/float16 are compared with
                       1e-6 of p            the reference run on their float32 upcast, as
                                            vLLM's sampler upcasts before filtering (the
                                            reference on raw bfloat16 would cumsum in bf16)
top-p, float32        same as top-p        devices without float64 (Ascend) sum the
window accumulation                         window in float32; checked on CPU by forcing it
kept probabilities     atol 1e-6, rtol 1e-5 softmax over the kept set vs over the masked
                                            vocabulary: the normaliser is summed in a
                                            different order
sample frequencies     5 standard errors    Monte-Carlo; 40k draws per case
=====================  ===================  ==============================================
"""

from __future__ import annotations

import pytest
import torch

from drama3_patches.kernels.sampling import (
    sample_top_k_top_p,
    top_k_top_p_filter,
    top_k_top_p_kept,
)

pytestmark = pytest.mark.vllm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _reference(logits, k, p):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    rows = logits.shape[0]
    kt = None if k is None else (k if isinstance(k, torch.Tensor) else torch.full((rows,), k))
    pt = None if p is None else (p if isinstance(p, torch.Tensor) else torch.full((rows,), float(p)))
    return apply_top_k_top_p_pytorch(logits.clone(), kt, pt)


def _ambiguous_tokens(logits32, k, p):
    """Per row, the ids on which a correct kernel may differ from the reference.

    Those whose exact (float64) mass before them is within 1e-6 of p, and those
    tied in value with the last kept or first dropped token (the reference's
    unstable sort picks among them arbitrarily).  Top-k runs first, as there.
    """
    base = logits32 if k is None else _reference(logits32, k, None)
    probs = base.double().softmax(dim=-1)
    out = []
    for row in range(base.shape[0]):
        sp, si = probs[row].sort(descending=True, stable=True)
        before = sp.cumsum(0) - sp
        pr = float(p[row]) if isinstance(p, torch.Tensor) else float(p)
        near = set(si[(before - pr).abs() < 1e-6].tolist())
        cut = int((before < pr).sum().clamp(min=1))
        values = base[row, si]
        edge = {float(values[cut - 1])} | ({float(values[cut])} if cut < len(values) else set())
        tied = {i for v in edge for i in (base[row] == v).nonzero().flatten().tolist()}
        out.append(near | tied)
    return out


def _assert_same_kept(got, want, allowed=None):
    diff = torch.isinf(got) != torch.isinf(want)
    for row in diff.any(dim=1).nonzero().flatten().tolist():
        ids = set(diff[row].nonzero().flatten().tolist())
        assert allowed is not None and ids <= allowed[row], (row, sorted(ids))
        # Ties swap members; only a near-boundary mass may change the count, by one.
        n_got, n_want = (~torch.isinf(got[row])).sum(), (~torch.isinf(want[row])).sum()
        assert abs(int(n_got) - int(n_want)) <= 1, (row, int(n_got), int(n_want))


def _logits(rows, vocab, seed, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 4096, 151936])
def test_top_k_only_matches_reference_exactly(dtype, vocab):
    logits = _logits(6, vocab, seed=vocab, dtype=dtype)
    k = torch.tensor([1, 2, 5, 30, vocab, vocab + 3]).clamp(min=1)
    got = top_k_top_p_filter(logits, k, None)
    want = _reference(logits, k.clamp(max=vocab), None)  # the reference cannot take k > vocab
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    kept = ~torch.isinf(got)
    assert torch.equal(got[kept], logits[kept]), "kept logits keep their values"
    assert got.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [50, 1000, 4096, 151936])
@pytest.mark.parametrize("mode", ["p", "k+p", "shared"])
def test_top_p_and_top_k_top_p_match_reference(dtype, vocab, mode):
    rows = 8
    logits = _logits(rows, vocab, seed=vocab + len(mode), dtype=dtype)
    g = torch.Generator().manual_seed(1)
    p = torch.rand(rows, generator=g) * 0.9 + 0.05
    p[0], p[1] = 1.0, 1e-9  # p = 1 disables; a tiny p keeps only the top token
    if mode == "p":
        k = None
    elif mode == "k+p":
        k = torch.randint(1, 60, (rows,), generator=g)
        k[2] = vocab  # no top-k for this row: it takes the top-p-only path
    else:
        k, p = 30, 0.9
    logits32 = logits.float()
    got = top_k_top_p_filter(logits, k, p)
    want = _reference(logits32, None if k is None else (k if isinstance(k, int) else k.clamp(max=vocab)), p)
    k_ref = None if k is None else (k if isinstance(k, int) else k.clamp(max=vocab))
    allowed = _ambiguous_tokens(logits32, k_ref, p)
    _assert_same_kept(got, want, allowed)
    if mode != "shared":
        assert (~torch.isinf(got[1])).sum() == 1 and got[1].argmax() == logits32[1].argmax()

    ids, probs = top_k_top_p_kept(logits, k, p)
    dense = torch.zeros(rows, vocab).scatter_add_(1, ids, probs)
    want_probs = want.softmax(dim=-1)
    exact_rows = [r for r in range(rows) if torch.equal(torch.isinf(got[r]), torch.isinf(want[r]))]
    assert len(exact_rows) >= rows - 2, "ambiguous boundaries must stay rare"
    torch.testing.assert_close(dense[exact_rows], want_probs[exact_rows], atol=1e-6, rtol=1e-5)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(rows), atol=1e-5)


def test_p_one_and_k_vocab_keep_everything():
    logits = _logits(3, 300, seed=9)
    assert torch.equal(top_k_top_p_filter(logits, 300, 1.0), logits)
    assert torch.equal(top_k_top_p_filter(logits, torch.tensor([0, -1, 10**6]), None), logits)
    for disabled in (0, -1, 300, 10**6):  # a shared k that disables top-k
        assert torch.equal(top_k_top_p_filter(logits, disabled, None), logits)
        torch.testing.assert_close(top_k_top_p_filter(logits, disabled, 0.5),
                                   top_k_top_p_filter(logits, None, 0.5))
    ids, probs = top_k_top_p_kept(logits, None, 1.0)
    assert ids.shape == (3, 300)
    torch.testing.assert_close(torch.zeros(3, 300).scatter_add_(1, ids, probs), logits.softmax(-1))


@pytest.mark.parametrize("ties", [3, 200])
def test_ties_at_the_top_k_boundary_are_all_kept(ties):
    # `ties` equal values straddle the k-th position; 200 runs past the topk window.
    vocab = 1000
    logits = _logits(2, vocab, seed=ties) - 10
    logits[:, 100:100 + ties] = 5.0
    logits[:, :4] = torch.tensor([9.0, 8.0, 7.0, 6.0])
    k = torch.tensor([5, 6])  # the 5th/6th value is one of the tied 5.0s
    got = top_k_top_p_filter(logits, k, None)
    want = _reference(logits, k, None)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert (~torch.isinf(got)).sum(dim=1).tolist() == [4 + ties, 4 + ties]
    p = torch.tensor([0.999, 0.5])  # the 0.5 boundary falls inside the tied run
    got_p = top_k_top_p_filter(logits, k, p)
    _assert_same_kept(got_p, _reference(logits, k, p), _ambiguous_tokens(logits, k, p))


def test_empty_batch():
    logits = torch.zeros(0, 151936)
    assert top_k_top_p_filter(logits, 30, 0.9).shape == (0, 151936)
    ids, probs = top_k_top_p_kept(logits, 30, 0.9)
    assert ids.shape[0] == 0 and probs.shape[0] == 0
    out = sample_top_k_top_p(logits, torch.zeros(0, dtype=torch.long), torch.zeros(0), 1.0)
    assert out.shape == (0,) and out.dtype == torch.long


def test_inputs_are_not_modified():
    logits = _logits(4, 5000, seed=3, dtype=torch.bfloat16)
    before = logits.clone()
    top_k_top_p_filter(logits, 20, 0.8)
    sample_top_k_top_p(logits, 20, 0.8, 0.7, generator=torch.Generator().manual_seed(0))
    sample_top_k_top_p(logits, None, 0.8)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "vocab,k,p,temp",
    [(40, 7, 0.8, 1.0), (600, None, 0.7, 0.8), (600, None, 0.97, 1.0), (300, 12, None, 1.3),
     (25, None, None, 0.5)],
)
def test_samples_follow_the_filtered_distribution(vocab, k, p, temp):
    draws = 40000
    row = _logits(1, vocab, seed=vocab + 1, scale=1.5)
    logits = row.expand(draws, vocab).contiguous()
    samples = sample_top_k_top_p(logits, k, p, temp, generator=torch.Generator().manual_seed(5))
    scaled = row / temp  # vLLM's sampler divides by the temperature before filtering
    want = _reference(scaled, k, p).softmax(dim=-1)[0]
    freq = torch.bincount(samples, minlength=vocab).double() / draws
    assert freq[want == 0].sum() == 0, "a filtered-out id was sampled"
    stderr = (want.double() * (1 - want.double()) / draws).sqrt()
    assert ((freq - want.double()).abs() <= 5 * stderr + 1e-9).all()


def test_seeded_generator_is_reproducible_and_seed_dependent():
    logits = _logits(64, 151936, seed=0)
    k = torch.full((64,), 30)
    a = sample_top_k_top_p(logits, k, 0.9, 1.0, generator=torch.Generator().manual_seed(1))
    b = sample_top_k_top_p(logits, k, 0.9, 1.0, generator=torch.Generator().manual_seed(1))
    c = sample_top_k_top_p(logits, k, 0.9, 1.0, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    kept = ~torch.isinf(_reference(logits, k, 0.9))
    assert kept.gather(1, a.unsqueeze(1)).all()


def test_greedy_rows_and_id_map():
    logits = _logits(4, 4096, seed=8, dtype=torch.float16)
    temp = torch.tensor([0.0, 1.0, 0.0, 0.7])
    id_map = torch.arange(4096) * 3 + 17  # index -> codebook id
    out = sample_top_k_top_p(logits, 50, 0.95, temp, generator=torch.Generator().manual_seed(0),
                             id_map=id_map)
    argmax = logits.argmax(dim=-1)
    assert out[0] == id_map[argmax[0]] and out[2] == id_map[argmax[2]]
    index = (out - 17) // 3
    assert torch.equal(index * 3 + 17, out)
    kept = ~torch.isinf(_reference(logits.float() / temp.clamp(min=1e-6).unsqueeze(1), 50, 0.95))
    assert kept.gather(1, index.unsqueeze(1)).all()
    all_greedy = sample_top_k_top_p(logits, None, None, 0.0)
    assert torch.equal(all_greedy, argmax)


def test_shared_k_equals_per_row_k():
    logits = _logits(16, 20000, seed=4, dtype=torch.bfloat16)
    a = top_k_top_p_filter(logits, 30, 0.9)
    b = top_k_top_p_filter(logits, torch.full((16,), 30), torch.full((16,), 0.9))
    assert torch.equal(a, b)
    ga = sample_top_k_top_p(logits, 30, 0.9, generator=torch.Generator().manual_seed(3))
    gb = sample_top_k_top_p(logits, torch.full((16,), 30), 0.9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(ga, gb)


def test_float32_accumulation_as_on_npu_keeps_the_reference_set(monkeypatch):
    # Devices without float64 (Ascend) accumulate the top-p window in float32.
    from drama3_patches.kernels import sampling

    monkeypatch.setattr(sampling, "_acc_dtype", lambda device: torch.float32)
    logits = _logits(16, 151936, seed=21)
    logits[:8, :300] += 9  # peaked rows: their nucleus fits the window
    p = torch.linspace(0.3, 0.95, 16)
    got = top_k_top_p_filter(logits, None, p)
    _assert_same_kept(got, _reference(logits, None, p), _ambiguous_tokens(logits, None, p))
