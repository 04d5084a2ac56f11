"""qwen3next-eager-attention on the real vLLM ``Qwen3NextAttention`` (tier 2), and which forward
runs for Drama 3 on NPU (vLLM-Ascend main's worker patch, stand-in under tests/replicas/).

Each test runs in a fork (the patch changes a real class). Layers are built with a TP=1 gloo
group and a CPU ``VllmConfig``; only the attention backend object is replaced (choosing a CPU
backend needs a full model config, and the QK path never touches it).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from support.logs import captured
from support.replicas import ASCEND_HOST_ENV, ASCEND_MAIN, prepend_profiles
from support.subproc import call
from support.tiers import TORCH_ABSENT
from support.vllm_state import enter_config, stub_attention, join_tp1_group

torch = pytest.importorskip("torch", reason=TORCH_ABSENT)
from support import fake_npu  # noqa: E402  (imports torch)

pytestmark = pytest.mark.vllm

PATCH = "qwen3next-eager-attention"
TARGET = "vllm.model_executor.models.qwen3_next:Qwen3NextAttention.__init__"
SMALL = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
             partial_rotary_factor=0.25, max_position_embeddings=4096, rms_norm_eps=1e-6)


def _boot(enabled: str, platform: str, device: str = "cpu") -> SimpleNamespace:
    """The engine's environment, a current VllmConfig and a TP=1 group (forked test or child)."""
    import os

    os.environ.update(DRAMA3_PATCHES=enabled, DRAMA3_PATCHES_PLATFORM=platform)
    import drama3_patches
    import vllm.model_executor.models.qwen3_next as qn
    from transformers import Qwen3NextConfig
    from vllm.config import DeviceConfig, VllmConfig

    stub_attention(qn)
    enter_config(VllmConfig(device_config=DeviceConfig(device=device)))
    join_tp1_group()
    return SimpleNamespace(d3p=drama3_patches, qn=qn, cfg=Qwen3NextConfig(**SMALL))


def _build(qn, cls=None, prefix="model.layers.3.self_attn", config=None):
    torch.set_default_dtype(torch.bfloat16)
    try:
        return (cls or qn.Qwen3NextAttention)(config, prefix=prefix)
    finally:
        torch.set_default_dtype(torch.float32)


def _state(d3p, patch_id=PATCH):
    return next(p for p in d3p.status()["patches"] if p["id"] == patch_id)


def _reload_saying_cuda(qn):
    # qwen3_next binds current_platform at import: re-execute it while vLLM's answer is CUDA.
    import vllm.platforms as vllm_platforms

    real = vllm_platforms.current_platform
    vllm_platforms.current_platform = fake_npu.SaysCuda(real)
    try:
        importlib.reload(qn)
    finally:
        vllm_platforms.current_platform = real
    stub_attention(qn)
    return real


def _params(layer) -> dict:
    return {k: (tuple(v.shape), str(v.dtype), hasattr(v, "weight_loader")) for k, v in layer.named_parameters()}


def _qk_inputs(layer, device="cpu"):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.q_norm.weight.copy_(torch.randn(256, generator=g) * 0.3)
        layer.k_norm.weight.copy_(torch.randn(256, generator=g) * 0.3)
    qkv = torch.randn(6, 2 * layer.q_size + 2 * layer.kv_size, generator=g).bfloat16()
    pos = torch.randint(0, 4096, (6,), generator=g)
    return qkv.to(device), pos.to(device)


def _eager_reference(layer, qkv, pos):
    from drama3_patches.kernels.qk_norm_rope_gate import qk_norm_rope_gate

    return qk_norm_rope_gate(qkv, pos, layer.q_norm.weight, layer.k_norm.weight, layer.rotary_emb.cos_sin_cache,
                             num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
                             rotary_dim=layer.rotary_emb.rotary_dim, eps=layer.q_norm.variance_epsilon)


@pytest.mark.forked
def test_applied_where_vllm_would_select_the_fused_kernel():
    # Started with DRAMA3_PATCHES=0: vLLM's platform answer is set before the plan runs.
    b = _boot("0", "npu")
    d3p, qn = b.d3p, b.qn
    from drama3_patches.patches.qwen3next_eager_attention import EagerPathError, is_eager_class

    # The port's marker: left alone.
    qn.Qwen3NextAttention._fish_omni_npu_eager = True
    d3p.apply([PATCH])
    state = _state(d3p)
    assert state["state"] == "not-needed" and "_fish_omni_npu_eager" in state["reason"]

    real = _reload_saying_cuda(qn)  # a fresh class, no marker; the import trigger plans again
    cls = qn.Qwen3NextAttention
    assert _state(d3p)["state"] == "applied"
    assert is_eager_class(cls) is True
    assert cls.__init__.__wrapped__ is d3p.get_original(TARGET)

    layer = _build(qn, config=b.cfg)
    assert layer.use_fused_qk_norm_rope_gate is False
    qkv, pos = _qk_inputs(layer)
    with torch.no_grad():
        got = layer._project_qkv_gate(qkv, pos)  # the fused branch would call Triton and fail here
        want = _eager_reference(layer, qkv, pos)
    assert [bool(torch.equal(a, w)) for a, w in zip(got, want)] == [True, True, True, True]
    patched_params = _params(layer)

    # A layer whose flag cannot be cleared is refused when its forward reads the flag...
    class StuckFused(cls):
        use_fused_qk_norm_rope_gate = property(lambda self: True, lambda self, value: None)

    with pytest.raises(EagerPathError) as refused:
        _build(qn, StuckFused, prefix="model.layers.7.self_attn", config=b.cfg)
    assert "model.layers.7.self_attn" in str(refused.value)
    assert "use_fused_qk_norm_rope_gate=True" in str(refused.value)

    # ...and left alone when its forward never reads it (what vLLM-Ascend's forward does); the
    # forward is named once in the log.
    class OwnForward(StuckFused):
        def forward(self, positions, hidden_states):
            return self.o_proj(self.qkv_proj(hidden_states)[0][..., : self.q_size])[0]

    with captured() as lines:
        kept = _build(qn, OwnForward, prefix="model.layers.11.self_attn", config=b.cfg)
    assert kept.use_fused_qk_norm_rope_gate is True
    named = [m for m in lines if "never calls _project_qkv_gate" in m]
    assert len(named) == 1 and "OwnForward.forward" in named[0], lines

    # Idempotent: applying again and reloading the module keep one layer of wrapping.
    d3p.apply()
    _reload_saying_cuda(qn)
    assert _state(d3p)["state"] == "applied"
    assert not hasattr(qn.Qwen3NextAttention.__init__.__wrapped__, "__wrapped__")
    assert is_eager_class(qn.Qwen3NextAttention) is True

    d3p.unapply()
    init = qn.Qwen3NextAttention.__init__
    assert not is_eager_class(qn.Qwen3NextAttention) and not hasattr(init, "__wrapped__")
    # Without the patch the same construction selects the fused kernel...
    plain = _build(qn, qn.Qwen3NextAttention, config=b.cfg)
    assert plain.use_fused_qk_norm_rope_gate is True
    # ...and the patched layer had exactly the same parameters and weight loaders.
    assert _params(plain) == patched_params and len(patched_params) > 0

    # Where vLLM's own check answers neither CUDA nor XPU (vLLM-Ascend's NPUPlatform is OOT; here
    # the CPU platform), there is nothing to do, and vLLM builds the layer eager.
    qn.current_platform = real
    d3p.apply([PATCH])
    state = _state(d3p)
    assert state["state"] == "not-needed", state["reason"]
    assert "neither CUDA nor XPU" in state["reason"]
    assert _build(qn, config=b.cfg).use_fused_qk_norm_rope_gate is False


def _split_qkv_rmsnorm_mrope_spy(calls: list) -> None:
    """vLLM-Ascend's Triton-Ascend op, registered on CPU: records its arguments."""
    lib = torch.library.Library("vllm", "FRAGMENT")
    lib.define("triton_split_qkv_rmsnorm_mrope(Tensor qkv, Tensor q_weight, Tensor k_weight, Tensor cos_sin, "
               "int num_q_heads, int num_kv_heads, int head_size, float eps, int[] mrope_section, "
               "bool is_interleaved, int? rope_dim=None, bool has_gate=False) -> (Tensor, Tensor, Tensor, Tensor)")

    def spy(qkv, q_weight, k_weight, cos_sin, num_q_heads, num_kv_heads, head_size, eps, mrope_section,
            is_interleaved, rope_dim=None, has_gate=False):
        calls.append({"mrope_section": list(mrope_section), "rope_dim": rope_dim, "has_gate": has_gate})
        n = qkv.shape[0]
        q = qkv.new_zeros(n, num_q_heads * head_size)
        return q, qkv.new_zeros(n, num_kv_heads * head_size), qkv.new_zeros(n, num_kv_heads * head_size), q.clone()

    lib.impl("triton_split_qkv_rmsnorm_mrope", spy, "CPU")
    _LIBS.append(lib)


_LIBS = []  # the registration lives as long as its Library object


@pytest.mark.forked
def test_on_an_ascend_worker_nothing_reads_the_flag():
    # Started with DRAMA3_PATCHES=0: vLLM-Ascend's worker patch (imported by adapt_patch() in
    # NPUWorker.__init__) swaps the forward before the plan runs.
    prepend_profiles(ASCEND_MAIN)
    b = _boot("0", "npu")
    d3p, qn = b.d3p, b.qn
    import vllm_ascend.patch.worker.patch_qwen3_5  # noqa: F401

    # Once vLLM-Ascend's worker patch is in, the forward that runs is its own.
    assert qn.Qwen3NextAttention.forward.__qualname__ == "AscendQwen3NextAttention.forward"
    d3p.apply([PATCH])
    state = _state(d3p)
    assert state["state"] == "not-needed"
    assert "vllm_ascend.patch.worker.patch_qwen3_5.AscendQwen3NextAttention.forward" in state["reason"]
    assert "never calls _project_qkv_gate" in state["reason"]

    # Drama 3's backbone config: FishOmniConfig.text_config (vllm-omni 0.32.0rc1), else the class it
    # converts to; vLLM's Qwen3_5 decoder layers hand it to Qwen3NextAttention.
    try:
        from vllm_omni.model_executor.models.fish_omni.configuration_fish_omni import FishOmniConfig
        text = FishOmniConfig(text_config={"model_type": "fish_qwen3_5_moe", **SMALL}).get_text_config()
    except ImportError:
        from transformers import Qwen3_5MoeTextConfig
        text = Qwen3_5MoeTextConfig(**SMALL)
    # A qwen3_5 text config: the Triton-Ascend op branch, never _project_qkv_gate.
    assert text.model_type == "qwen3_5_moe_text"

    def project_called(*args, **kwargs):
        raise AssertionError("_project_qkv_gate was called")

    qn.Qwen3NextAttention._project_qkv_gate = project_called
    calls = []
    _split_qkv_rmsnorm_mrope_spy(calls)

    def run_forward(config):
        layer = _build(qn, config=config)
        hidden = torch.randn(4, 512, dtype=torch.bfloat16)
        try:
            with torch.no_grad():
                layer.forward(torch.arange(4), hidden)
            return ["ok", type(layer.rotary_emb).__name__]
        except Exception as exc:
            return [type(exc).__name__ + ": " + str(exc), type(layer.rotary_emb).__name__]

    # With plain (non-mRoPE) rope parameters that branch reads rotary_emb.mrope_section, which a
    # plain rotary embedding lacks; with mRoPE sections it reaches the op.
    default_rope = run_forward(text)
    assert default_rope[1] == "RotaryEmbedding"
    assert default_rope[0].startswith("AttributeError") and "mrope_section" in default_rope[0]
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    mrope = run_forward(text)
    # (vLLM-Omni's patch swaps vLLM's MRotaryEmbedding for its OmniMRotaryEmbedding subclass.)
    assert mrope[0] == "ok" and mrope[1].endswith("MRotaryEmbedding")
    assert calls == [{"mrope_section": [11, 11, 10], "rope_dim": 64, "has_gate": True}]
    assert run_forward(b.cfg)[0] == "ok"  # not qwen3_5: vLLM-Ascend's eager branch


@pytest.mark.forked
def test_cuda_platform_is_skipped():
    b = _boot("1", "cuda")
    b.d3p.apply()
    state = _state(b.d3p)
    assert state["state"] == "skipped"
    assert "platform cuda" in state["reason"]


@pytest.mark.npu
def test_on_a_real_npu_a_patched_layer_takes_the_eager_qk_path():
    """Ascend host only. On the real stack the patch is not needed (vLLM's platform is vLLM-Ascend's
    NPUPlatform, or its worker patch owns the forward), and says why; where vLLM's platform check
    answers CUDA the engine applies it, and the real layer, built on the NPU, takes the eager QK
    path there, matching the eager kernel on the CPU. A fresh interpreter: the device runtime must
    not start in a fork."""
    out = call(eager_layer_on_the_npu, env=ASCEND_HOST_ENV, timeout=900)
    state, reason = out["real_platform"]
    assert state == "not-needed", reason
    assert "neither CUDA nor XPU" in reason or "never calls _project_qkv_gate" in reason, reason
    assert out["forced"] == "applied"
    assert out["fused_flag"] is False and out["device"] == "npu"
    assert out["max_err"] <= 2 ** -6, out  # bf16: one rounding step at |x| ~ 4


def eager_layer_on_the_npu() -> dict:
    """The child of the test above."""
    import torch_npu  # noqa: F401

    b = _boot("1", "npu", device="npu")
    d3p, qn = b.d3p, b.qn
    d3p.apply([PATCH])
    out = {"real_platform": [_state(d3p)["state"], _state(d3p)["reason"]]}
    d3p.unapply([PATCH])
    _reload_saying_cuda(qn)
    d3p.apply([PATCH])
    out["forced"] = _state(d3p)["state"]
    with torch.device("npu", torch.npu.current_device()):
        layer = _build(qn, config=b.cfg)
    out["fused_flag"] = layer.use_fused_qk_norm_rope_gate
    out["device"] = layer.q_norm.weight.device.type
    qkv, pos = _qk_inputs(layer, "npu")
    with torch.no_grad():
        got = layer._project_qkv_gate(qkv, pos)
        cpu_layer = {k: v.cpu() for k, v in (("q", layer.q_norm.weight), ("k", layer.k_norm.weight),
                                             ("cache", layer.rotary_emb.cos_sin_cache))}
        from drama3_patches.kernels.qk_norm_rope_gate import qk_norm_rope_gate
        want = qk_norm_rope_gate(qkv.cpu(), pos.cpu(), cpu_layer["q"], cpu_layer["k"], cpu_layer["cache"],
                                 num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
                                 rotary_dim=layer.rotary_emb.rotary_dim, eps=layer.q_norm.variance_epsilon)
    torch.npu.synchronize()
    out["max_err"] = max(float((a.cpu().float() - w.float()).abs().max()) for a, w in zip(got, want))
    return out
