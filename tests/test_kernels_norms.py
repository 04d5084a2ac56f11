"""Norm, embedding+norm and gating kernels against vLLM's torch-native references.

References (vLLM 0.31 / 0.32, tier 2): ``GemmaRMSNorm.forward_native`` and
``RMSNorm.forward_native`` (``vllm.model_executor.layers.layernorm``), with and
without the fused residual add; ``torch.nn.functional.embedding`` followed by
``GemmaRMSNorm.forward_native`` for the tower embedding; vLLM's attention
gate expression ``attn_output * torch.sigmoid(gate)``.

Tolerance table (all dtypes float32 / bfloat16 / float16):

================================  ============  ==========================================
kernel                            tolerance     why
================================  ============  ==========================================
rms_norm, gemma_rms_norm          bit-exact     same float32 op sequence as vLLM's native
  (and the residual variants)                   op; only the temporaries differ
tower_embed_norm, one codebook    bit-exact     lookup is a copy, then the same norm
tower_embed_norm, C codebooks     bit-exact     reference sums the C rows in float32 too
sigmoid_gate                      bit-exact     same two elementwise ops in the same dtype
================================  ============  ==========================================
"""

from __future__ import annotations

import pytest
import torch

from drama3_patches.kernels.gating import sigmoid_gate
from drama3_patches.kernels.norms import gemma_rms_norm, rms_norm, tower_embed_norm

pytestmark = pytest.mark.vllm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(0, 64), (1, 7), (5, 256), (3, 4, 130)]  # empty batch, odd sizes, 3-D


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    # CustomOps read the current config when built; a CPU device config is enough.
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))

    def build(factory):
        with set_current_vllm_config(config):
            return factory()

    return build


def _weight(hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(hidden, generator=g) * 0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rms_norm_matches_vllm_native(vllm_config, dtype, shape, with_residual):
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    hidden = shape[-1]
    ref = vllm_config(lambda: GemmaRMSNorm(hidden, eps=1e-6))
    with torch.no_grad():
        ref.weight.copy_(_weight(hidden, torch.float32, 1).to(dtype))
    ref = ref.to(dtype)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    res = torch.randn(shape, generator=g).to(dtype) if with_residual else None
    x_before = x.clone()

    got = gemma_rms_norm(x, ref.weight.data, 1e-6, residual=res)
    want = ref.forward_native(x.clone(), None if res is None else res.clone())

    assert torch.equal(x, x_before), "the kernel must not modify its input"
    if with_residual:
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0].dtype == dtype and got[1].dtype == dtype
    else:
        assert got.dtype == dtype
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_vllm_native(vllm_config, dtype, with_residual):
    from vllm.model_executor.layers.layernorm import RMSNorm

    ref = vllm_config(lambda: RMSNorm(96, eps=1e-5)).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(_weight(96, torch.float32, 3).to(dtype) + 1)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 96, generator=g).to(dtype)
    res = torch.randn(9, 96, generator=g).to(dtype) if with_residual else None
    got = rms_norm(x, ref.weight.data, 1e-5, residual=res)
    want = ref.forward_native(x.clone(), None if res is None else res.clone())
    if with_residual:
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    else:
        assert torch.equal(got, want)


def test_gemma_weight_is_applied_as_one_plus_w():
    # With a zero offset the norm is the plain RMS normalisation.
    x = torch.tensor([[3.0, -4.0]])
    out = gemma_rms_norm(x, torch.zeros(2), eps=0.0)
    rms = (12.5) ** 0.5
    assert torch.allclose(out, x / rms)
    out2 = gemma_rms_norm(x, torch.ones(2), eps=0.0)
    assert torch.allclose(out2, 2 * x / rms)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tower_embed_norm_matches_embedding_then_vllm_norm(vllm_config, dtype):
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    g = torch.Generator().manual_seed(5)
    table = torch.randn(4096 * 3, 64, generator=g).to(dtype)
    norm = vllm_config(lambda: GemmaRMSNorm(64, eps=1e-6)).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_weight(64, dtype, 6))

    ids = torch.randint(0, 4096, (11,), generator=g)
    got = tower_embed_norm(ids, table, norm.weight.data, 1e-6)
    assert torch.equal(got, norm.forward_native(table[ids]))

    codes = torch.randint(0, 4096, (11, 3), generator=g)
    got = tower_embed_norm(codes, table, norm.weight.data, 1e-6, codebook_size=4096)
    summed = sum(table[codes[:, c] + c * 4096].float() for c in range(3)).to(dtype)
    assert torch.equal(got, norm.forward_native(summed))

    empty = tower_embed_norm(ids[:0], table, norm.weight.data, 1e-6)
    assert empty.shape == (0, 64) and empty.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_matches_attention_gate_expression(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 33, generator=g).to(dtype)
    gate = (torch.randn(6, 33, generator=g) * 4).to(dtype)
    x_before, gate_before = x.clone(), gate.clone()
    out = sigmoid_gate(x, gate)
    assert torch.equal(out, x * torch.sigmoid(gate))
    assert torch.equal(x, x_before) and torch.equal(gate, gate_before)
    # Broadcast gate (one per row) still gives x's shape.
    row_gate = gate[:, :1]
    assert torch.equal(sigmoid_gate(x, row_gate), x * torch.sigmoid(row_gate))
    assert sigmoid_gate(x[:0], gate[:0]).shape == (0, 33)
