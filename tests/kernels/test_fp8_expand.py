"""CPU block-FP8 -> bfloat16 expansion: bit identity (both kernels), hand-over, errors, bounds, knobs."""

from __future__ import annotations

import weakref

import pytest

from support.tiers import TORCH_ABSENT

torch = pytest.importorskip("torch", reason=TORCH_ABSENT)
from drama3_patches.kernels import fp8 as k8  # noqa: E402
from drama3_patches.kernels import fp8_build  # noqa: E402
from support import fake_npu  # noqa: E402

KERNELS = ["native", "torch"]


@pytest.fixture(params=KERNELS)
def kernel(request):
    """Each kernel in turn; native needs a C compiler (CI and dev hosts have gcc)."""
    if request.param == "native" and fp8_build._compiler() is None:
        pytest.skip("no C compiler here: the native fp8 kernel cannot be built")
    return request.param


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Random fp8 codes with every one of the 256 codes present (NaN, -0, subnormals)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n * k,), dtype=torch.uint8, generator=g)
    m = min(256, n * k)
    codes[:m] = torch.randperm(256, generator=g)[:m].to(torch.uint8)
    return codes.view(n, k).view(torch.float8_e4m3fn)


def _scale(n: int, k: int, seed: int, magnitude: float = 1e-2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    shape = k8.expected_scale_shape((n, k))
    return torch.rand(shape, generator=g) * magnitude + magnitude / 16


SHAPES = [(1, 1), (3, 200), (127, 129), (128, 128), (130, 300), (257, 128), (200, 64), (384, 256)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_bit_identical_to_naive(n, k, transposed, kernel):
    w, s = _weight(n, k, n * 1000 + k), _scale(n, k, n + k)
    ref = k8.reference_dequant(w, s)
    assert torch.isnan(ref.float()).any() or n * k < 256  # NaN codes are exercised
    for chunk in ((None, 256, 128, 40, 7) if kernel == "torch" else (None,)):
        got = k8.dequant_block_fp8(w, s, transposed=transposed, chunk_rows=chunk, kernel=kernel)
        want = ref.t() if transposed else ref
        assert got.shape == want.shape and got.is_contiguous()
        assert torch.equal(_bits(got), _bits(want)), (n, k, transposed, chunk)


# tiny (bf16 subnormal / underflow), the edges of the native table's range (2**-120, 2**118),
# large (the torch path's 2**8 fold is skipped), overflow to inf, negative
@pytest.mark.parametrize("magnitude", [1e-45, 1e-30, 2.0**-121, 2.0**-120, 1e-3, 3.0e2, 2.0**101, 2.0**118,
                                       2.0**119, 1e36, -2.5e-3])
def test_scale_extremes_bit_identical(magnitude, kernel):
    w, s = _weight(260, 300, 7), _scale(260, 300, 7, magnitude)
    if abs(magnitude) in (2.0**-121, 2.0**-120, 2.0**118, 2.0**119):
        s.fill_(magnitude)  # exactly on (or just outside) the edge, every block
    ref = k8.reference_dequant(w, s)
    for transposed in (False, True):
        got = k8.dequant_block_fp8(w, s, transposed=transposed, kernel=kernel)
        assert torch.equal(_bits(got), _bits(ref.t() if transposed else ref))


def test_special_scales_and_bf16_scale(kernel):
    w = _weight(256, 256, 3)
    s = _scale(256, 256, 3)
    s[0, 0], s[1, 1] = float("inf"), float("nan")
    s[0, 1], s[1, 0] = 0.0, -0.0
    for transposed in (False, True):
        ref = k8.reference_dequant(w, s)
        got = k8.dequant_block_fp8(w, s, transposed=transposed, kernel=kernel)
        assert torch.equal(_bits(got), _bits(ref.t() if transposed else ref))
    s16 = _scale(256, 256, 4).to(torch.bfloat16)
    got = k8.dequant_block_fp8(w, s16, transposed=True, kernel=kernel)
    assert torch.equal(_bits(got), _bits(k8.reference_dequant(w, s16).t()))


def test_exact_fallback_path_matches(monkeypatch):
    # Where float16 subnormals would be flushed, the kernel uses torch's own fp8 conversion.
    monkeypatch.setattr(k8, "_fast_path_exact", lambda: False)
    w, s = _weight(130, 300, 11), _scale(130, 300, 11)
    got = k8.dequant_block_fp8(w, s, transposed=True, kernel="torch")
    assert torch.equal(_bits(got), _bits(k8.reference_dequant(w, s).t()))


def test_fast_path_probe_is_true_here():
    assert k8._fast_path_exact() is True


@pytest.mark.parametrize("block", [(64, 32), (1, 7), (200, 300), (128, 256)])
def test_non_default_block_size(block, kernel):
    w = _weight(700, 600, 5)
    s = torch.rand(k8.expected_scale_shape((700, 600), block))
    ref = k8.reference_dequant(w, s, block_size=block)
    for transposed in (False, True):
        got = k8.dequant_block_fp8(w, s, transposed=transposed, block_size=block, chunk_rows=16, kernel=kernel)
        assert torch.equal(_bits(got), _bits(ref.t() if transposed else ref))


def test_strided_sources_and_outputs(kernel):
    # What the patch hands over: row slices of the stacked host tensor (gate rows of w13) and a
    # column slice of the stacked output (the gate half of (H, 2I)).
    stacked = _weight(2 * 200, 300, 8)
    gate = stacked[:200]
    cols = stacked[:, :150]  # non-contiguous rows: stride 300
    s = _scale(200, 300, 8)
    s_cols = _scale(400, 150, 9)
    out = torch.full((300, 2 * 200), 7.0, dtype=torch.bfloat16)
    k8.dequant_block_fp8(gate, s, transposed=True, out=out[:, :200], kernel=kernel)
    assert torch.equal(_bits(out[:, :200]), _bits(k8.reference_dequant(gate, s).t()))
    assert (out[:, 200:] == 7.0).all()  # nothing written outside the slice
    got = k8.dequant_block_fp8(cols, s_cols, kernel=kernel)
    assert torch.equal(_bits(got), _bits(k8.reference_dequant(cols, s_cols)))


def test_mismatched_scale_error_names_expert_and_shapes():
    w = [_weight(256, 384, 1), _weight(256, 384, 2)]
    s = [_scale(256, 384, 1), torch.ones(2, 2)]
    out = torch.empty(2, 384, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as info:
        k8.dequant_experts(w, s, out, name="layers.3.mlp.experts.w13_weight")
    msg = str(info.value)
    for part in ("layers.3.mlp.experts.w13_weight expert 1", "(2, 2)", "(256, 384)", "(2, 3)"):
        assert part in msg, msg


def test_wrong_dtype_and_out_shape_errors():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        k8.dequant_block_fp8(torch.zeros(4, 4), torch.ones(1, 1))
    w, s = _weight(128, 256, 1), _scale(128, 256, 1)
    with pytest.raises(ValueError, match="does not fit out shape"):
        k8.dequant_experts([w], [s], torch.empty(1, 128, 256, dtype=torch.bfloat16), transposed=True)

    # One stacked tensor cannot hand its experts over: a clear error, nothing written.
    out = torch.full((1, 256, 128), 7.0, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"weights must be a list or dict .* pass list\(weights.unbind\(0\)\)"):
        k8.dequant_experts(w.unsqueeze(0), [s], out)
    with pytest.raises(TypeError, match="scales must be a list or dict"):
        k8.dequant_experts([w], s.unsqueeze(0), out)
    assert (out == 7.0).all()


class _Handover(list):
    """Records, each time an expert is taken, which earlier experts are already freed."""

    def __init__(self, items, refs, log):
        super().__init__(items)
        self.refs, self.log = refs, log

    def __getitem__(self, i):
        self.log.append((i, [r() is None for r in self.refs[:i]]))
        return super().__getitem__(i)


def test_each_fp8_source_is_released_before_the_next_expert():
    n, k, e = 200, 300, 4
    refs, log = [], []
    items = []
    for i in range(e):
        t = _weight(n, k, i)
        refs.append(weakref.ref(t))
        items.append(t)
    weights = _Handover(items, refs, log)
    del items, t
    scales = {i: _scale(n, k, i) for i in range(e)}
    expected = [k8.reference_dequant(r(), scales[i]) for i, r in enumerate(refs)]
    done = []
    out = torch.empty(e, k, n, dtype=torch.bfloat16)
    k8.dequant_experts(weights, scales, out, on_expert_done=done.append)
    assert [i for i, _ in log] == list(range(e))
    for i, freed in log:
        assert all(freed), f"expert {i} taken while earlier fp8 sources are alive: {freed}"
    assert all(r() is None for r in refs) and list(weights) == [None] * e and scales == {}
    assert done == list(range(e))
    for i in range(e):
        assert torch.equal(_bits(out[i]), _bits(expected[i].t()))


def test_stacked_layer_in_checkpoint_layout():
    w = [_weight(256, 200, i) for i in range(3)]
    s = [_scale(256, 200, i) for i in range(3)]
    ref = [k8.reference_dequant(a, b) for a, b in zip(w, s)]
    out = torch.empty(3, 256, 200, dtype=torch.bfloat16)
    k8.dequant_experts(list(w), list(s), out, transposed=False)
    assert all(torch.equal(_bits(out[i]), _bits(ref[i])) for i in range(3))


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768), (768, 2048), (2048, 1536), (256, 7168), (7168, 256)])
def test_scratch_stays_under_one_expert(n, k, threads):
    # Output (K, N) per expert: the workers' buffers + the transposed codes fit in one bf16 expert.
    rows, width = k, n
    chunk = k8.default_chunk_rows(rows, width, transposed=True, workers=threads)
    workers = k8._Workers(threads, chunk, width)
    codes = workers.codes_for(rows, width)
    used = sum(s.f32.numel() * 4 + s.u8.numel() for s in workers.scratches) + codes.numel()
    assert used <= n * k * 2, (chunk, used, n * k * 2)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_threads_give_the_same_bits_and_restore_torch_threads(threads, kernel):
    before = torch.get_num_threads()
    w = [_weight(1100, 520, i) for i in range(3)]
    s = [_scale(1100, 520, i) for i in range(3)]
    ref = [k8.reference_dequant(a, b) for a, b in zip(w, s)]
    for transposed in (True, False):
        out = torch.empty((3, 520, 1100) if transposed else (3, 1100, 520), dtype=torch.bfloat16)
        k8.dequant_experts(list(w), list(s), out, transposed=transposed, num_threads=threads, chunk_rows=40,
                           kernel=kernel)
        assert all(torch.equal(_bits(out[i]), _bits(ref[i].t() if transposed else ref[i])) for i in range(3))
    assert torch.get_num_threads() == before


@pytest.mark.forked
def test_expansion_into_device_output_uses_blocking_copies():
    fake_npu.enable()
    e, n, k = 3, 256, 300
    w = [_weight(n, k, i) for i in range(e)]
    s = [_scale(n, k, i) for i in range(e)]
    ref = [k8.reference_dequant(a, b) for a, b in zip(w, s)]
    out = torch.empty(e, k, n, dtype=torch.bfloat16, device="npu")
    with fake_npu.record_transfers() as log:
        k8.dequant_experts(list(w), list(s), out)
    assert out.device.type == "npu"
    assert [(t.direction, t.non_blocking) for t in log] == [("h2d", False)] * e
    host = out.cpu()
    assert all(torch.equal(_bits(host[i]), _bits(ref[i].t())) for i in range(e))


@pytest.mark.npu
def test_on_a_real_npu_device_output_is_bit_exact():
    """Ascend host only: experts expanded on the CPU land in an NPU tensor bit for bit."""
    import torch_npu  # noqa: F401

    e, n, k = 4, 1536, 2048
    w = [_weight(n, k, i) for i in range(e)]
    s = [_scale(n, k, i) for i in range(e)]
    ref = [k8.reference_dequant(a, b) for a, b in zip(w, s)]
    out = torch.empty(e, k, n, dtype=torch.bfloat16, device="npu")
    k8.dequant_experts(list(w), list(s), out)
    torch.npu.synchronize()
    host = out.cpu()
    assert all(torch.equal(_bits(host[i]), _bits(ref[i].t())) for i in range(e))
