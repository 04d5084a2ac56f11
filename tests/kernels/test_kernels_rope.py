"""RoPE and the QK-norm + RoPE + gate split against vLLM's torch-native paths.

References (vLLM 0.31 / 0.32, tier 2):

* ``apply_rope``: ``RotaryEmbedding.forward_native`` (NeoX and GPT-J layouts,
  full and partial rotary dimension, the Drama 3 shape head 256 / rotary 64).
* ``qk_norm_rope_gate``: (a) the composition of vLLM's native pieces exactly as
  the eager branch of ``Qwen3NextAttention._project_qkv_gate`` chains them
  (split, ``GemmaRMSNorm.forward_native`` per head, ``RotaryEmbedding``
  native forward), in this process; (b) ``_project_qkv_gate`` of a real
  ``Qwen3NextAttention`` layer built on the CPU in a forked test (TP=1 gloo
  group, a CPU ``VllmConfig``; only the ``Attention`` backend object is
  replaced there, because choosing a CPU backend needs a full model config
  and the QK path never touches it).

Tolerance table (float32 / bfloat16 / float16):

==========================  =========  =================================================
kernel                      tolerance  why
==========================  =========  =================================================
apply_rope                  bit-exact  cos/sin cast to the query dtype and the same
                                       products and sums in the same dtype and order
qk_norm_rope_gate           bit-exact  the same norm (float32, one rounding) and RoPE;
                                       v and gate are the same slices of the input
==========================  =========  =================================================
"""

from __future__ import annotations

import pytest

from support.tiers import TORCH_ABSENT
from support.vllm_state import stub_attention, join_tp1_group

torch = pytest.importorskip("torch", reason=TORCH_ABSENT)
from drama3_patches.kernels.qk_norm_rope_gate import qk_norm_rope_gate  # noqa: E402
from drama3_patches.kernels.rope import apply_rope  # noqa: E402

pytestmark = pytest.mark.vllm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def build():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))

    def make(factory):
        with set_current_vllm_config(config):
            return factory()

    return make


def _rope(build, head, rotary, neox, dtype, max_pos=512):
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    return build(lambda: RotaryEmbedding(head, rotary, max_pos, 10000.0, neox, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head,rotary,neox",
    [(256, 64, True), (64, 64, True), (128, 32, False), (18, 10, True)],
)
@pytest.mark.parametrize("tokens", [0, 1, 13])
def test_rope_matches_vllm_native(build, dtype, head, rotary, neox, tokens):
    emb = _rope(build, head, rotary, neox, dtype)
    g = torch.Generator().manual_seed(tokens + head)
    q = torch.randn(tokens, 4 * head, generator=g).to(dtype)
    k = torch.randn(tokens, 2 * head, generator=g).to(dtype)
    pos = torch.randint(0, 512, (tokens,), generator=g)
    q_before = q.clone()

    got_q, got_k = apply_rope(pos, q, k, emb.cos_sin_cache, head, rotary, neox)
    assert torch.equal(q, q_before), "the kernel must not modify its input"
    assert got_q.shape == q.shape and got_k.shape == k.shape and got_q.dtype == dtype
    if tokens == 0:
        return  # vLLM's native path cannot view an empty batch; shapes are the contract
    want_q, want_k = emb.forward_native(pos, q.clone(), k.clone())
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k)
    # Channels past the rotary dimension pass through.
    assert torch.equal(got_q.view(tokens, 4, head)[..., rotary:], q.view(tokens, 4, head)[..., rotary:])


def test_rope_without_key(build):
    emb = _rope(build, 64, 32, True, torch.float32)
    q = torch.randn(3, 128)
    pos = torch.tensor([0, 5, 9])
    got_q, got_k = apply_rope(pos, q, None, emb.cos_sin_cache, 64, 32, True)
    want_q, _ = emb.forward_native(pos, q.clone(), None)
    assert got_k is None and torch.equal(got_q, want_q)


def _eager_reference(build, qkv, pos, qw, kw, emb, heads, kv_heads, head, gate):
    """The eager branch of Qwen3NextAttention._project_qkv_gate, with vLLM's native ops."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    q_norm = build(lambda: GemmaRMSNorm(head, eps=1e-6))
    k_norm = build(lambda: GemmaRMSNorm(head, eps=1e-6))
    with torch.no_grad():
        q_norm.weight.copy_(qw.float())
        k_norm.weight.copy_(kw.float())
    q_norm, k_norm = q_norm.to(qw.dtype), k_norm.to(kw.dtype)
    q_size, kv_size = heads * head, kv_heads * head
    if gate:
        q_gate, k, v = qkv.split([2 * q_size, kv_size, kv_size], dim=-1)
        q_gate = q_gate.view(-1, heads, 2 * head)
        q, g = torch.chunk(q_gate, 2, dim=-1)
        q, g = q.reshape(-1, q_size), g.reshape(-1, q_size)
    else:
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        g = None
    q = q_norm.forward_native(q.view(-1, heads, head)).view(-1, q_size)
    k = k_norm.forward_native(k.reshape(-1, kv_heads, head)).view(-1, kv_size)
    q, k = emb.forward_native(pos, q, k)
    return q, k, v, g


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("tokens", [1, 7])
def test_qk_norm_rope_gate_matches_vllm_eager_composition(build, dtype, gate, tokens):
    heads, kv_heads, head, rotary = 4, 2, 256, 64  # Drama 3: head 256, partial rotary 64
    emb = _rope(build, head, rotary, True, dtype, max_pos=4096)
    g = torch.Generator().manual_seed(11 + tokens)
    width = heads * head * (2 if gate else 1) + 2 * kv_heads * head
    qkv = (torch.randn(tokens, width, generator=g) * 2).to(dtype)
    pos = torch.randint(0, 4096, (tokens,), generator=g)
    qw = (torch.randn(head, generator=g) * 0.3).to(dtype)
    kw = (torch.randn(head, generator=g) * 0.3).to(dtype)

    got = qk_norm_rope_gate(
        qkv, pos, qw, kw, emb.cos_sin_cache, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head, rotary_dim=rotary, eps=1e-6, attn_output_gate=gate,
    )
    want = _eager_reference(build, qkv, pos, qw, kw, emb, heads, kv_heads, head, gate)
    for name, a, b in zip("qkvg", got, want):
        if b is None:
            assert a is None
            continue
        assert a.dtype == dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name


def test_qk_norm_rope_gate_empty_batch(build):
    emb = _rope(build, 64, 16, True, torch.bfloat16)
    qkv = torch.zeros(0, 2 * 2 * 64 + 2 * 64, dtype=torch.bfloat16)
    q, k, v, g = qk_norm_rope_gate(
        qkv, torch.zeros(0, dtype=torch.long), torch.zeros(64), torch.zeros(64), emb.cos_sin_cache,
        num_heads=2, num_kv_heads=1, head_dim=64, rotary_dim=16, eps=1e-6,
    )
    assert q.shape == (0, 128) and k.shape == (0, 64) and v.shape == (0, 64) and g.shape == (0, 128)


@pytest.mark.forked
def test_qk_norm_rope_gate_matches_real_qwen3next_layer():
    # Forked: a TP group and vLLM's current config for the rest of the process.
    import vllm.model_executor.models.qwen3_next as qn
    from transformers import Qwen3NextConfig
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    stub_attention(qn)
    cfg = Qwen3NextConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                          partial_rotary_factor=0.25, max_position_embeddings=4096, rms_norm_eps=1e-6)
    checked = 0
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        join_tp1_group()
        for dtype in DTYPES:
            torch.set_default_dtype(dtype)
            try:
                layer = qn.Qwen3NextAttention(cfg, prefix="model.layers.3.self_attn")
            finally:
                torch.set_default_dtype(torch.float32)
            assert not layer.use_fused_qk_norm_rope_gate  # CPU platform: the eager branch
            assert layer.rotary_emb.rotary_dim == 64
            g = torch.Generator().manual_seed(3)
            with torch.no_grad():
                layer.q_norm.weight.copy_(torch.randn(256, generator=g) * 0.3)
                layer.k_norm.weight.copy_(torch.randn(256, generator=g) * 0.3)
            for tokens in (1, 9):
                qkv = (torch.randn(tokens, 2 * layer.q_size + 2 * layer.kv_size, generator=g) * 2).to(dtype)
                pos = torch.randint(0, 4096, (tokens,), generator=g)
                want = layer._project_qkv_gate(qkv, pos)
                got = qk_norm_rope_gate(
                    qkv, pos, layer.q_norm.weight, layer.k_norm.weight, layer.rotary_emb.cos_sin_cache,
                    num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
                    rotary_dim=layer.rotary_emb.rotary_dim, eps=layer.q_norm.variance_epsilon)
                key = (dtype, tokens)
                assert [bool(torch.equal(a, b)) for a, b in zip(got, want)] == [True] * 4, key
                assert {a.dtype for a in got} == {dtype}, key
                checked += 1
    assert checked == 6
