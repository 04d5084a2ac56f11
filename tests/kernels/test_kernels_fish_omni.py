"""The eager kernels against the published Triton kernels, run by Triton's interpreter on CPU.

References (tier 3): vllm-omni 0.32.0rc1 ``fish_omni/kernels.py`` (``tower_mix_norm``,
``gemma_rms_norm``, ``gemma_rms_norm_table``, ``sigmoid_gate``,
``draw_top_k_top_p``) and vLLM 0.32's
``model_executor/layers/fused_qk_norm_rope.py`` (``fused_qk_rmsnorm_rope_gate``),
imported in one fresh interpreter after ``support.triton_interpret.enable()``.
The child compares every case and returns the measured differences; the
tests below assert on them (and print them with ``-s``).

Rounding: the reference runs twice, with the interpreter converting float32
to bfloat16 as GPU Triton does (round to nearest even, "rne") and as the
stock interpreter does (truncation, "trunc").

Tolerances (ulp = units in the last place of the output dtype, counted across
zero; float16 conversions round to nearest even in both modes):

==========================  ==============  =================================================
what                        tolerance       why
==========================  ==============  =================================================
bf16 / fp16, rne            <= 1 ulp        the algorithm and every rounding point are the
                                            kernel's; only the float32 row sums are added in
                                            another order (numpy's pairwise sum in the
                                            interpreter, a tree on the GPU, torch's vector
                                            sum here), which can move a float32 result by an
                                            ulp and so, rarely, flip a final rounding
float32, rne                <= 8 ulp        the same summation order (a few float32 ulp
                                            through rsqrt); sigmoid's exp is numpy's in the
                                            interpreter and torch's here
float32, exactly summable   bit-exact       inputs whose sums are exact in any order: the
data (norms)                                norms then agree bit for bit
bf16, trunc, one rounding   <= 1 ulp        truncation vs nearest-even of the same value
bf16, trunc, tower_mix /    <= 2 ulp of     the kernel rounds an intermediate (embedding /
fused QK                    the row's max   normalised head) to bf16 first: truncated there
                                            too, then rotated or normalised again
draw_top_k_top_p            same tokens     same ``uniform`` noise, every case
==========================  ==============  =================================================
"""

from __future__ import annotations


import pytest

from support.replicas import FISH_OMNI_ABSENT, has_fish_omni
from support.subproc import call

pytestmark = pytest.mark.vllm


def measure_child() -> dict:
    """Every case, eager against published (interpreted): the measured differences."""
    import time
    from support import triton_interpret
    triton_interpret.enable()
    import torch
    from vllm_omni.model_executor.models.fish_omni import kernels as published
    from vllm.model_executor.layers.fused_qk_norm_rope import fused_qk_rmsnorm_rope_gate as published_qk
    from drama3_patches.kernels import gating, norms, sampling
    from drama3_patches.kernels.qk_norm_rope_gate import fused_qk_rmsnorm_rope_gate as eager_qk

    NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

    def ordered(t):
        # float bits as integers that count ulps across zero (-0 and +0 are one value)
        bits = t.contiguous().view(INT[t.dtype]).to(torch.int64)
        low = -(1 << (8 * t.element_size() - 1))
        return torch.where(bits < 0, low - bits, bits)

    def diff(got, want):
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
        if got.numel() == 0:
            return {"ulp": 0, "ne": 0, "n": 0, "abs": 0.0, "row_ulp": 0.0}
        d = (got.float() - want.float()).abs()
        out = {"ulp": int((ordered(got) - ordered(want)).abs().max()), "ne": int((got != want).sum()),
               "n": got.numel(), "abs": float(d.max())}
        # the difference in ulps of each row's largest magnitude (for intermediate roundings)
        rows = want.float().reshape(want.shape[0], -1)
        row_ulp = torch.finfo(want.dtype).eps * rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        out["row_ulp"] = float((d.reshape(rows.shape) / row_ulp).max())
        return out

    results = []
    def record(kernel, case, mode, dtype, parts):
        results.append({"kernel": kernel, "case": case, "mode": mode, "dtype": NAMES.get(dtype, str(dtype)),
                        "parts": parts})

    g = torch.Generator().manual_seed(1234)
    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def dyadic(*shape, dtype=torch.float32):
        # multiples of 1/8 in [-4, 4): squares and their sums are exact in float32 in any order
        return (torch.randint(-32, 32, shape, generator=g).float() / 8).to(dtype)

    NORM_SHAPES = [(0, 24), (1, 24), (13, 100), (3, 2048)]
    DTYPES = [torch.float32, torch.bfloat16, torch.float16]
    t0 = time.time()

    # ---- norms and gate -----------------------------------------------------------------------
    norm_inputs = []
    for dtype in DTYPES:
        for rows, dim in NORM_SHAPES:
            if dim == 2048 and dtype != torch.bfloat16:
                continue  # the model's width, in the model's dtype only (interpreter time)
            for data in ("randn", "dyadic") if dtype == torch.float32 else ("randn",):
                make = (lambda *s: randn(*s, scale=2.0, dtype=dtype)) if data == "randn" else \
                       (lambda *s: dyadic(*s, dtype=dtype))
                x, r, extra, gate = make(rows, dim), make(rows, dim), make(rows, dim), make(rows, dim)
                w = dyadic(dim) / 4 if data == "dyadic" else randn(dim, scale=0.3)
                w2 = dyadic(dim) / 4 if data == "dyadic" else randn(dim, scale=0.3, dtype=dtype)
                table_rows = 7
                table = make(table_rows, dim)
                code = torch.randint(-3, table_rows + 3, (rows,), generator=g)  # out of range: clamped
                if rows > 1:
                    code[0], code[1] = -1, table_rows  # both clamp edges, always
                code = code.to(torch.int32) if rows == 13 else code
                mask = torch.rand(rows, generator=g) > 0.3
                norm_inputs.append((dtype, f"{rows}x{dim}/{data}", x, r, extra, gate, w, w2, table, code, mask))

    for mode in ("rne", "trunc"):
        triton_interpret.bf16_rounding("nearest-even" if mode == "rne" else "truncate")
        for dtype, case, x, r, extra, gate, w, w2, table, code, mask in norm_inputs:
            if mode == "trunc" and dtype != torch.bfloat16:
                continue  # truncation only changes bf16 conversions
            record("gemma_rms_norm", case, mode, dtype,
                   {"out": diff(norms.gemma_rms_norm(x, w, 1e-6), published.gemma_rms_norm(x, w, 1e-6))})
            got, want = norms.gemma_rms_norm(x, w, 1e-5, r), published.gemma_rms_norm(x, w, 1e-5, r)
            record("gemma_rms_norm+residual", case, mode, dtype,
                   {"out": diff(got[0], want[0]), "residual": diff(got[1], want[1])})
            got = norms.gemma_rms_norm_table(x, code, mask, table, w2, 1e-6)
            want = published.gemma_rms_norm_table(x, code, mask, table, w2, 1e-6)
            record("gemma_rms_norm_table", case, mode, dtype, {"out": diff(got[0], want[0]), "residual": diff(got[1], want[1])})
            for e in (None, extra):
                got = norms.tower_mix_norm(x, code, mask, table, e, w, w2, 1e-6)
                want = published.tower_mix_norm(x, code, mask, table, e, w, w2, 1e-6)
                record("tower_mix_norm" + ("+extra" if e is not None else ""), case, mode, dtype,
                       {"out": diff(got, want)})
            record("sigmoid_gate", case, mode, dtype, {"out": diff(gating.sigmoid_gate(x, gate), published.sigmoid_gate(x, gate))})

    # ---- vLLM's fused QK norm + RoPE + gate ---------------------------------------------------
    # (tokens, q heads, kv heads, head_dim, rotary_dim, mrope_section); the last is Drama 3's tower
    QK_CASES = [(0, 2, 1, 24, 8, None), (1, 2, 1, 24, 8, None), (5, 3, 2, 40, 40, None), (7, 2, 1, 36, 24, (4, 4, 4)),
                (4, 1, 1, 64, 32, (6, 5, 5)), (2, 16, 2, 256, 64, None)]
    qk_inputs = []
    for dtype in (torch.bfloat16, torch.float16):
        for tokens, heads, kv, head_dim, rotary, mrope in QK_CASES:
            q_gate = randn(tokens, heads * 2 * head_dim, scale=2.0, dtype=dtype)
            k = randn(tokens, kv * head_dim, dtype=dtype)
            q_w, k_w = randn(head_dim, scale=0.3), randn(head_dim, scale=0.3, dtype=dtype)
            cache = randn(50, rotary)  # any values: the kernel reads [cos | sin] from it
            pos = torch.randint(0, 50, (3, tokens) if mrope else (tokens,), generator=g)
            pos = pos.to(torch.int32) if tokens == 5 else pos
            # codebook_tower passes a column slice of the qkv projection: strided rows
            wide = torch.cat((q_gate, k), dim=1) if tokens else q_gate
            q_gate_view = wide[:, : q_gate.shape[1]]
            qk_inputs.append((dtype, f"T{tokens} H{heads}/{kv} D{head_dim} R{rotary} mrope={mrope}",
                              q_gate_view, k, q_w, k_w, cache, pos, heads, kv, head_dim, rotary, mrope))
    for mode in ("rne", "trunc"):
        triton_interpret.bf16_rounding("nearest-even" if mode == "rne" else "truncate")
        for dtype, case, q_gate, k, q_w, k_w, cache, pos, heads, kv, head_dim, rotary, mrope in qk_inputs:
            if mode == "trunc" and dtype != torch.bfloat16:
                continue
            for beta in (0.0, 1.0):
                args = (q_gate, k, q_w, k_w, cache, pos, 1e-6, heads, kv, head_dim, rotary)
                got = eager_qk(*args, mrope_section=mrope, norm_beta=beta)
                want = published_qk(*args, mrope_section=mrope, norm_beta=beta)
                record("fused_qk_rmsnorm_rope_gate", f"{case} beta={beta}", mode, dtype,
                       {"q": diff(got[0], want[0]), "k": diff(got[1], want[1]), "gate": diff(got[2], want[2])})

    # the same argument errors
    errors = []
    qg, kk = torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16)
    w8, cache8, pos2 = torch.zeros(8), torch.zeros(9, 8), torch.zeros(2, dtype=torch.int64)
    bad_calls = {
        "odd rotary": (qg, kk, w8, w8, cache8, pos2, 1e-6, 2, 1, 8, 7),
        "rotary > head": (qg, kk, w8, w8, cache8, pos2, 1e-6, 2, 1, 8, 10),
        "float32": (qg.float(), kk.float(), w8, w8, cache8, pos2, 1e-6, 2, 1, 8, 8),
        "mixed dtypes": (qg, kk.half(), w8, w8, cache8, pos2, 1e-6, 2, 1, 8, 8),
        "strided weight": (qg, kk, torch.zeros(8, 2)[:, 0], w8, cache8, pos2, 1e-6, 2, 1, 8, 8),
        "3-D positions": (qg, kk, w8, w8, cache8, torch.zeros(1, 1, 2, dtype=torch.int64), 1e-6, 2, 1, 8, 8),
        "position count": (qg, kk, w8, w8, cache8, torch.zeros(3, dtype=torch.int64), 1e-6, 2, 1, 8, 8),
        "mrope without section": (qg, kk, w8, w8, cache8, torch.zeros(3, 2, dtype=torch.int64), 1e-6, 2, 1, 8, 8),
    }
    for name, args in bad_calls.items():
        raised = []
        for fn in (eager_qk, published_qk):
            try:
                fn(*args)
                raised.append(None)
            except ValueError:
                raised.append("ValueError")
        errors.append({"case": name, "eager": raised[0], "published": raised[1]})
    for name, kwargs in {"section with 1-D positions": {"mrope_section": (2, 1, 1)},
                         "section sum": {"mrope_section": (1, 1, 1)}}.items():
        p = pos2 if "1-D" in name else torch.zeros(3, 2, dtype=torch.int64)
        raised = []
        for fn in (eager_qk, published_qk):
            try:
                fn(qg, kk, w8, w8, cache8, p, 1e-6, 2, 1, 8, 8, **kwargs)
                raised.append(None)
            except ValueError:
                raised.append("ValueError")
        errors.append({"case": name, "eager": raised[0], "published": raised[1]})

    # ---- the frame draw -------------------------------------------------------------------------
    triton_interpret.bf16_rounding("nearest-even")
    draws = []
    def draw_case(name, logits, temperature, top_k, top_p, uniform, max_top_k, id_map=None, top=None):
        args = (logits, temperature, top_k, top_p, uniform, max_top_k, id_map, top)
        got, want = sampling.draw_top_k_top_p(*args), published.draw_top_k_top_p(*args)
        draws.append({"case": name, "rows": logits.shape[0], "same": bool(torch.equal(got, want)),
                      "dtype": str(got.dtype), "want_dtype": str(want.dtype), "mismatch": int((got != want).sum()),
                      "distinct": int(want.unique().numel()) if want.numel() else 0})

    for rows, vocab, kmax, dtype in ((0, 10, 4, torch.float32), (1, 37, 4, torch.float32), (48, 300, 16, torch.float32),
                                     (48, 300, 16, torch.bfloat16), (64, 4096, 64, torch.float32),
                                     (8, 151936, 64, torch.bfloat16)):
        logits = randn(rows, vocab, scale=3.0, dtype=dtype)
        temperature = torch.rand(rows, generator=g) * 1.5 + 0.05
        top_k = torch.randint(1, kmax + 8, (rows,), generator=g)  # beyond max_top_k too
        top_p = torch.rand(rows, generator=g) * 0.9 + 0.1
        if rows >= 8:
            temperature[0::8] = 0.0          # below min_temperature: the argmax
            temperature[1::8] = 1e-5
            top_k[2::8] = 1                  # rank 0 only
            top_p[3::8] = 1e-6               # rank 0 only (its mass exceeds p)
            top_p[4::8] = 1.0
            top_k[5::8] = 0                  # no rank passes `rank < top_k`, rank 0 is still kept
        uniform = torch.rand(rows, 3, kmax, generator=g)  # the sampler's noise: a strided slice per draw
        uniform[:, 1, : kmax // 2] = 0.0     # floored at 1e-30
        name = f"{rows}x{vocab} K{kmax} {NAMES[dtype]}"
        draw_case(name, logits, temperature, top_k, top_p, uniform[:, 1], kmax)
        id_map = torch.randperm(vocab, generator=g) + 1000
        draw_case(name + " id_map", logits, temperature, top_k, top_p, uniform[:, 2], kmax, id_map)
        if rows:
            top = torch.topk(logits, kmax, dim=-1)
            draw_case(name + " shared top", logits, temperature, top_k, top_p, uniform[:, 0], kmax, id_map, top)

    # ties: equal logits and equal noise, so scores tie and the first rank must win
    rows, vocab, kmax = 32, 64, 8
    logits = torch.randint(0, 3, (rows, vocab), generator=g).float()
    uniform = torch.full((rows, kmax), 0.5)
    draw_case("ties: 3 logit levels, equal noise", logits, torch.ones(rows), torch.full((rows,), kmax),
              torch.ones(rows), uniform, kmax)
    logits = torch.zeros(rows, vocab)
    draw_case("ties: flat logits", logits, torch.ones(rows), torch.randint(1, kmax + 1, (rows,), generator=g),
              torch.ones(rows), torch.rand(rows, kmax, generator=g), kmax)
    top = torch.topk(logits, kmax, dim=-1)
    draw_case("ties: flat logits, shared top", logits, torch.ones(rows), torch.full((rows,), kmax), torch.ones(rows),
              torch.rand(rows, kmax, generator=g), kmax, torch.arange(vocab) * 7, top)

    return {"norms": results, "qk_errors": errors, "draws": draws, "seconds": time.time() - t0}


@pytest.fixture(scope="module")
def measured():
    if not has_fish_omni():
        pytest.skip(FISH_OMNI_ABSENT)
    # A fresh interpreter: Triton's interpreter must be on before any module with Triton kernels
    # imports, which the test process may already have done.
    return call(measure_child, timeout=900)


def _cases(records, kernel, mode, dtype):
    return [r for r in records if r["kernel"] == kernel and r["mode"] == mode and r["dtype"] == dtype]


NORM_KERNELS = ["gemma_rms_norm", "gemma_rms_norm+residual", "gemma_rms_norm_table", "tower_mix_norm",
                "tower_mix_norm+extra", "sigmoid_gate"]


@pytest.mark.parametrize("kernel", NORM_KERNELS)
def test_norms_and_gate_round_like_the_gpu_kernel(measured, kernel):
    for dtype in ("bf16", "fp16"):
        cases = _cases(measured["norms"], kernel, "rne", dtype)
        assert len(cases) >= 3, cases
        for rec in cases:
            for part, d in rec["parts"].items():
                assert d["ulp"] <= 1, (dtype, rec["case"], part, d)
    # Most elements agree bit for bit; the rest are the float32 sums' rounding flips.
    same = sum(d["n"] - d["ne"] for r in _cases(measured["norms"], kernel, "rne", "bf16") for d in r["parts"].values())
    total = sum(d["n"] for r in _cases(measured["norms"], kernel, "rne", "bf16") for d in r["parts"].values())
    assert same >= 0.95 * total, (same, total)


@pytest.mark.parametrize("kernel", NORM_KERNELS)
def test_float32_within_summation_order(measured, kernel):
    for rec in _cases(measured["norms"], kernel, "rne", "fp32"):
        for part, d in rec["parts"].items():
            assert d["ulp"] <= 8, (rec["case"], part, d)
            if rec["case"].endswith("dyadic") and kernel != "sigmoid_gate":
                assert d["ne"] == 0, (rec["case"], part, d)  # exact sums: bit for bit


@pytest.mark.parametrize("kernel", NORM_KERNELS)
def test_bf16_against_the_truncating_interpreter(measured, kernel):
    intermediate = kernel.startswith("tower_mix_norm")
    for rec in _cases(measured["norms"], kernel, "trunc", "bf16"):
        for part, d in rec["parts"].items():
            if intermediate:
                assert d["row_ulp"] <= 2, (rec["case"], part, d)
            else:
                assert d["ulp"] <= 1, (rec["case"], part, d)


def test_fused_qk_norm_rope_gate(measured):
    recs = [r for r in measured["norms"] if r["kernel"] == "fused_qk_rmsnorm_rope_gate"]
    assert {(r["mode"], r["dtype"]) for r in recs} == {("rne", "bf16"), ("rne", "fp16"), ("trunc", "bf16")}
    for rec in recs:
        for part, d in rec["parts"].items():
            if part == "gate":
                assert d["ne"] == 0, (rec, part)  # a verbatim copy
            elif rec["mode"] == "rne":
                assert d["ulp"] <= 1, (rec["dtype"], rec["case"], part, d)
            else:
                assert d["row_ulp"] <= 2, (rec["case"], part, d)
    assert any(r["parts"]["q"]["n"] > 0 and "mrope=(" in r["case"] for r in recs)


def test_fused_qk_refuses_the_same_arguments(measured):
    for e in measured["qk_errors"]:
        assert e["eager"] == e["published"] == "ValueError", e


def test_draw_gives_the_published_tokens_for_the_same_noise(measured):
    draws = measured["draws"]
    assert len(draws) >= 18
    for d in draws:
        assert d["same"] and d["mismatch"] == 0, d
        assert d["dtype"] == d["want_dtype"] == "torch.int64", d
    # the cases draw real variety, not one token everywhere
    assert max(d["distinct"] for d in draws) >= 20


def test_report(measured, capsys):
    """Print the measured maxima (shown with -s; the numbers quoted in notes come from here)."""
    rows = {}
    for rec in measured["norms"]:
        key = (rec["kernel"], rec["mode"], rec["dtype"])
        for d in rec["parts"].values():
            u, a, n, ne = rows.get(key, (0, 0.0, 0, 0))
            rows[key] = (max(u, d["ulp"]), max(a, d["abs"]), n + d["n"], ne + d["ne"])
    with capsys.disabled():
        print(f"\ninterpreter child: {measured['seconds']:.1f} s")
        for (kernel, mode, dtype), (u, a, n, ne) in sorted(rows.items()):
            print(f"{kernel:<28} {mode:<5} {dtype}: max {u} ulp, max |diff| {a:.3g}, {ne}/{n} elements differ")
        print(f"draw_top_k_top_p: {sum(d['same'] for d in measured['draws'])}/{len(measured['draws'])} cases "
              f"identical, {sum(d['rows'] for d in measured['draws'])} rows")
    assert rows


def test_eager_kernels_leave_their_inputs_alone():
    """float32 inputs are where ``.to(float32)`` aliases the caller's tensor: nothing may be written back."""
    import torch

    from drama3_patches.kernels import gating, norms, sampling
    from drama3_patches.kernels.qk_norm_rope_gate import fused_qk_rmsnorm_rope_gate

    g = torch.Generator().manual_seed(3)
    x, r, gate, extra, table = (torch.randn(5, 16, generator=g) for _ in range(5))
    w, code, mask = torch.randn(16, generator=g), torch.tensor([0, 3, 9, -1, 2]), torch.tensor([1.0, 0, 1, 1, 0.5])
    logits, uniform = torch.randn(5, 40, generator=g), torch.rand(5, 8, generator=g)
    per_row = dict(temperature=torch.ones(5), top_k=torch.full((5,), 8), top_p=torch.full((5,), 0.9))
    q_gate, k = torch.randn(5, 64, generator=g).bfloat16(), torch.randn(5, 16, generator=g).bfloat16()
    cache, pos = torch.randn(10, 8, generator=g), torch.arange(5)
    inputs = [x, r, gate, extra, table, w, code, mask, logits, uniform, q_gate, k, cache, pos, *per_row.values()]
    before = [t.clone() for t in inputs]
    norms.gemma_rms_norm(x, w, 1e-6)
    norms.gemma_rms_norm(x, w, 1e-6, r)
    norms.gemma_rms_norm_table(x, code, mask, table, w, 1e-6)
    norms.tower_mix_norm(x, code, mask, table, extra, w, w, 1e-6)
    gating.sigmoid_gate(x, gate)
    sampling.draw_top_k_top_p(logits, *per_row.values(), uniform, 8)
    fused_qk_rmsnorm_rope_gate(q_gate, k, w, w, cache, pos, 1e-6, 2, 1, 16, 8)
    assert all(torch.equal(a, b) for a, b in zip(inputs, before))


@pytest.mark.npu
def test_eager_kernels_on_ascend_match_cpu():
    """On an Ascend host: each eager kernel on NPU tensors matches the same kernel on CPU: the same tokens,
    bf16 within 2 ulp of each row's largest value (the NPU sums float32 rows in its own order, and the
    fused QK rounds an intermediate). Where torch_npu has the fused norms the NPU side takes them
    (``kernels.npu_fused``; tests/hardware/test_npu_fused_norms.py compares the two NPU paths)."""
    # A fresh interpreter: the device runtime must not start in the test process, which forks.
    r = call(eager_kernels_on_the_npu, timeout=600)
    assert r.pop("draw_same") is True
    assert all(v <= 2 for v in r.values()), r


def eager_kernels_on_the_npu() -> dict:
    """The child of the test above: each kernel on CPU and on NPU tensors."""
    import torch
    import torch_npu  # noqa: F401
    from drama3_patches.kernels import gating, norms, sampling
    from drama3_patches.kernels.qk_norm_rope_gate import fused_qk_rmsnorm_rope_gate

    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    x, r, e = (torch.randn(37, 2048, generator=g).to(bf) for _ in range(3))
    w, table = torch.randn(2048, generator=g) * 0.3, torch.randn(4096, 2048, generator=g).to(bf)
    code, mask = torch.randint(-2, 4100, (37,), generator=g), torch.rand(37, generator=g) > 0.2
    q_gate, k = torch.randn(37, 16 * 512, generator=g).to(bf), torch.randn(37, 2 * 256, generator=g).to(bf)
    cache, pos = torch.randn(4096, 64, generator=g), torch.randint(0, 4096, (37,), generator=g)
    hw = torch.randn(256, generator=g) * 0.3
    logits, uniform = torch.randn(64, 151936, generator=g) * 3, torch.rand(64, 64, generator=g)
    per_row = (torch.full((64,), 0.8), torch.full((64,), 30), torch.full((64,), 0.9))
    calls = {
        "gemma_rms_norm": lambda d: norms.gemma_rms_norm(d(x), d(w), 1e-6, d(r)),
        "gemma_rms_norm_table": lambda d: norms.gemma_rms_norm_table(d(x), d(code), d(mask), d(table), d(w), 1e-6),
        "tower_mix_norm": lambda d: (norms.tower_mix_norm(d(x), d(code), d(mask), d(table), d(e), d(w), d(w), 1e-6),),
        "sigmoid_gate": lambda d: (gating.sigmoid_gate(d(x), d(r)),),
        "fused_qk": lambda d: fused_qk_rmsnorm_rope_gate(d(q_gate), d(k), d(hw), d(hw), d(cache), d(pos), 1e-6,
                                                        16, 2, 256, 64, norm_beta=1.0),
    }
    out = {}
    for name, run in calls.items():
        cpu, npu = run(lambda t: t), run(lambda t: t.npu())
        # the difference in bf16 ulps of each row's largest magnitude
        out[name] = max(float(((a.float() - b.cpu().float()).abs()
                               / (a.float().abs().amax(-1, keepdim=True).clamp_min(1e-30) * 2 ** -7)).max())
                        for a, b in zip(cpu, npu))
    draw = lambda d: sampling.draw_top_k_top_p(d(logits), *map(d, per_row), d(uniform), 64)  # noqa: E731
    out["draw_same"] = bool(torch.equal(draw(lambda t: t), draw(lambda t: t.npu()).cpu()))
    return out
