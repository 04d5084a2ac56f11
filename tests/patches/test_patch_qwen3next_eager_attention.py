"""qwen3next-eager-attention on the real vLLM ``Qwen3NextAttention`` (tier 2), and which forward
runs for Drama 3 on NPU (vLLM-Ascend main's worker patch, stand-in under tests/replicas/).

Each test runs a fresh interpreter (the patch changes a real class). Layers are built with a TP=1
gloo group and a CPU ``VllmConfig``; only the attention backend object is replaced (choosing a
CPU backend needs a full model config, and the QK path never touches it).
"""

from __future__ import annotations


import pytest

from support.replicas import ASCEND_MAIN, profile_paths
from support.subproc import result_of, run_python

pytestmark = pytest.mark.vllm

TARGET = "vllm.model_executor.models.qwen3_next:Qwen3NextAttention.__init__"

PRELUDE = r"""
import json, os, tempfile, torch
import drama3_patches
from transformers import Qwen3NextConfig
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
import vllm.model_executor.models.qwen3_next as qn

class NoBackendAttention(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()
    def forward(self, q, k, v):
        return q

qn.Attention = NoBackendAttention

class SaysCuda:  # vLLM's platform check answering CUDA
    def __init__(self, real):
        self._real = real
    def __getattr__(self, name):
        return getattr(self._real, name)
    def is_cuda(self):
        return True

SMALL = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
             partial_rotary_factor=0.25, max_position_embeddings=4096, rms_norm_eps=1e-6)
CFG = Qwen3NextConfig(**SMALL)
CTX = set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu")))
CTX.__enter__()
init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                             distributed_init_method="file://" + tempfile.mktemp())
initialize_model_parallel(1, 1)

def build(cls=None, prefix="model.layers.3.self_attn", config=None):
    torch.set_default_dtype(torch.bfloat16)
    try:
        return (cls or qn.Qwen3NextAttention)(config or CFG, prefix=prefix)
    finally:
        torch.set_default_dtype(torch.float32)

def state(patch_id="qwen3next-eager-attention"):
    return next(p for p in drama3_patches.status()["patches"] if p["id"] == patch_id)

out = {}
"""

# Started with DRAMA3_PATCHES=0: the child sets vLLM's platform answer before the plan runs.
APPLIED_CHILD = PRELUDE + r"""
import logging
from drama3_patches.kernels.qk_norm_rope_gate import qk_norm_rope_gate
from drama3_patches.patches.qwen3next_eager_attention import EagerPathError, is_eager_class
messages = []
class Grab(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("vllm.drama3_patches").addHandler(Grab())
logging.getLogger("vllm.drama3_patches").setLevel(logging.INFO)

import importlib
import vllm.platforms as vllm_platforms
REAL = qn.current_platform

def reload_saying_cuda():
    # qwen3_next binds current_platform at import: re-execute it while vLLM's answer is CUDA.
    vllm_platforms.current_platform = SaysCuda(REAL)
    try:
        importlib.reload(qn)
    finally:
        vllm_platforms.current_platform = REAL
    qn.Attention = NoBackendAttention

# The in-tree port's class marker: nothing to do.
qn.Qwen3NextAttention._fish_omni_npu_eager = True
drama3_patches.apply(["qwen3next-eager-attention"])
out["marker_state"] = [state()["state"], state()["reason"]]

reload_saying_cuda()   # a fresh class, no marker; the import trigger plans again
cls = qn.Qwen3NextAttention
out["state"] = state()["state"]
original = drama3_patches.get_original("TARGET")
out["marker"] = is_eager_class(cls)
out["wrapped_is_original"] = cls.__init__.__wrapped__ is original

layer = build()
out["fused"] = layer.use_fused_qk_norm_rope_gate
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    layer.q_norm.weight.copy_(torch.randn(256, generator=g) * 0.3)
    layer.k_norm.weight.copy_(torch.randn(256, generator=g) * 0.3)
qkv = torch.randn(6, 2 * layer.q_size + 2 * layer.kv_size, generator=g).bfloat16()
pos = torch.randint(0, 4096, (6,), generator=g)
with torch.no_grad():
    got = layer._project_qkv_gate(qkv, pos)   # the fused branch would call Triton and fail here
    want = qk_norm_rope_gate(qkv, pos, layer.q_norm.weight, layer.k_norm.weight,
                             layer.rotary_emb.cos_sin_cache, num_heads=layer.num_heads,
                             num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
                             rotary_dim=layer.rotary_emb.rotary_dim, eps=layer.q_norm.variance_epsilon)
out["eager_equal"] = [bool(torch.equal(a, b)) for a, b in zip(got, want)]
patched_params = {k: (tuple(v.shape), str(v.dtype), hasattr(v, "weight_loader"))
                  for k, v in layer.named_parameters()}

# A layer whose flag cannot be cleared is refused when its forward reads the flag...
class StuckFused(cls):
    use_fused_qk_norm_rope_gate = property(lambda self: True, lambda self, value: None)
try:
    build(StuckFused, prefix="model.layers.7.self_attn")
    out["refused"] = None
except EagerPathError as exc:
    out["refused"] = str(exc)

# ...and left alone when its forward never reads it (what vLLM-Ascend's forward does).
class OwnForward(StuckFused):
    def forward(self, positions, hidden_states):
        return self.o_proj(self.qkv_proj(hidden_states)[0][..., : self.q_size])[0]
messages.clear()
kept = build(OwnForward, prefix="model.layers.11.self_attn")
out["own_forward_kept"] = kept.use_fused_qk_norm_rope_gate
out["own_forward_log"] = [m for m in messages if "never calls _project_qkv_gate" in m]

# Idempotent: applying again and reloading the module keep one layer of wrapping.
drama3_patches.apply()
reload_saying_cuda()
out["after_reload_state"] = state()["state"]
out["after_reload_one_layer"] = not hasattr(qn.Qwen3NextAttention.__init__.__wrapped__, "__wrapped__")
out["after_reload_marker"] = is_eager_class(qn.Qwen3NextAttention)

drama3_patches.unapply()
init = qn.Qwen3NextAttention.__init__
out["restored"] = not is_eager_class(qn.Qwen3NextAttention) and not hasattr(init, "__wrapped__")
plain = build(qn.Qwen3NextAttention)
out["unpatched_fused"] = plain.use_fused_qk_norm_rope_gate
plain_params = {k: (tuple(v.shape), str(v.dtype), hasattr(v, "weight_loader"))
                for k, v in plain.named_parameters()}
out["same_params"] = plain_params == patched_params and len(plain_params) > 0

# Where vLLM's own check answers neither CUDA nor XPU (vLLM-Ascend's NPUPlatform is OOT; here
# the CPU platform), there is nothing to do.
qn.current_platform = REAL
drama3_patches.apply(["qwen3next-eager-attention"])
out["real_platform"] = [state()["state"], state()["reason"]]
out["real_platform_flag"] = build().use_fused_qk_norm_rope_gate
print("RESULT" + json.dumps(out))
""".replace('"TARGET"', repr(TARGET))

# Started with DRAMA3_PATCHES=0: vLLM-Ascend's worker patch (imported by adapt_patch() in
# NPUWorker.__init__) swaps the forward before the plan runs.
ASCEND_CHILD = PRELUDE + r"""
import vllm_ascend.patch.worker.patch_qwen3_5 as ascend_qwen3_5
out["forward"] = qn.Qwen3NextAttention.forward.__qualname__
drama3_patches.apply(["qwen3next-eager-attention"])
out["after_ascend_patch"] = [state()["state"], state()["reason"]]

# Drama 3's backbone config: FishOmniConfig.text_config (vllm-omni 0.32.0rc1), else the class it
# converts to; vLLM's Qwen3_5 decoder layers hand it to Qwen3NextAttention.
try:
    from vllm_omni.model_executor.models.fish_omni.configuration_fish_omni import FishOmniConfig
    text = FishOmniConfig(text_config={"model_type": "fish_qwen3_5_moe", **SMALL}).get_text_config()
    out["config_from"] = "FishOmniConfig"
except ImportError:
    from transformers import Qwen3_5MoeTextConfig
    text = Qwen3_5MoeTextConfig(**SMALL)
    out["config_from"] = "Qwen3_5MoeTextConfig"
out["drama3_model_type"] = text.model_type

def project_called(*args, **kwargs):
    raise AssertionError("_project_qkv_gate was called")
qn.Qwen3NextAttention._project_qkv_gate = project_called

calls = []
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

def run_forward(config):
    layer = build(config=config)
    hidden = torch.randn(4, 512, dtype=torch.bfloat16)
    try:
        with torch.no_grad():
            layer.forward(torch.arange(4), hidden)
        return ["ok", type(layer.rotary_emb).__name__]
    except Exception as exc:
        return [type(exc).__name__ + ": " + str(exc), type(layer.rotary_emb).__name__]

out["drama3_default_rope"] = run_forward(text)
# The same backbone config with Qwen3.5's interleaved mRoPE sections in its rope parameters.
text.rope_parameters = {**text.rope_parameters, "mrope_section": [11, 11, 10], "mrope_interleaved": True}
out["drama3_mrope"] = run_forward(text)
out["op_calls"] = calls
out["qwen3_next_config"] = run_forward(CFG)[0]   # not qwen3_5: vLLM-Ascend's eager branch
print("RESULT" + json.dumps(out))
"""

CUDA_CHILD = PRELUDE + r"""
drama3_patches.apply()
out["state"] = state()["state"]
out["reason"] = state()["reason"]
print("RESULT" + json.dumps(out))
"""


def _result(code, platform, enabled="1", pythonpath=None):
    env = {"DRAMA3_PATCHES": enabled, "DRAMA3_PATCHES_PLATFORM": platform}
    proc = run_python(code, env=env, pythonpath=pythonpath, timeout=300)
    return result_of(proc)


def test_applied_where_vllm_would_select_the_fused_kernel():
    r = _result(APPLIED_CHILD, "npu", enabled="0")
    # The port's marker: left alone.
    assert r["marker_state"][0] == "not-needed" and "_fish_omni_npu_eager" in r["marker_state"][1]
    assert r["state"] == "applied"
    assert r["marker"] is True and r["wrapped_is_original"] is True
    assert r["fused"] is False
    assert r["eager_equal"] == [True, True, True, True]
    assert r["refused"] is not None and "model.layers.7.self_attn" in r["refused"]
    assert "use_fused_qk_norm_rope_gate=True" in r["refused"]
    # A forward that never reads the flag: the layer is not refused, and the forward is named.
    assert r["own_forward_kept"] is True
    assert len(r["own_forward_log"]) == 1 and "OwnForward.forward" in r["own_forward_log"][0]
    assert r["after_reload_state"] == "applied"
    assert r["after_reload_one_layer"] is True and r["after_reload_marker"] is True
    assert r["restored"] is True
    # Without the patch the same construction selects the fused kernel...
    assert r["unpatched_fused"] is True
    # ...and the patched layer has exactly the same parameters and weight loaders.
    assert r["same_params"] is True
    # vLLM's own check answering "not CUDA/XPU": not needed, and vLLM builds the layer eager.
    state, reason = r["real_platform"]
    assert state == "not-needed", reason
    assert "neither CUDA nor XPU" in reason
    assert r["real_platform_flag"] is False


def test_on_an_ascend_worker_nothing_reads_the_flag():
    r = _result(ASCEND_CHILD, "npu", enabled="0", pythonpath=profile_paths(ASCEND_MAIN))
    # Once vLLM-Ascend's worker patch is in, the forward that runs is its own.
    assert r["forward"] == "AscendQwen3NextAttention.forward"
    state, reason = r["after_ascend_patch"]
    assert state == "not-needed"
    assert "vllm_ascend.patch.worker.patch_qwen3_5.AscendQwen3NextAttention.forward" in reason
    assert "never calls _project_qkv_gate" in reason
    # Drama 3's text config is a qwen3_5 one: the Triton-Ascend op branch, never _project_qkv_gate.
    assert r["drama3_model_type"] == "qwen3_5_moe_text"
    # With plain (non-mRoPE) rope parameters that branch reads rotary_emb.mrope_section, which a
    # plain rotary embedding lacks; with mRoPE sections it reaches the op.
    assert r["drama3_default_rope"][1] == "RotaryEmbedding"
    assert r["drama3_default_rope"][0].startswith("AttributeError") and "mrope_section" in r["drama3_default_rope"][0]
    # (vLLM-Omni's patch swaps vLLM's MRotaryEmbedding for its OmniMRotaryEmbedding subclass.)
    assert r["drama3_mrope"][0] == "ok" and r["drama3_mrope"][1].endswith("MRotaryEmbedding")
    assert r["op_calls"] == [{"mrope_section": [11, 11, 10], "rope_dim": 64, "has_gate": True}]
    assert r["qwen3_next_config"] == "ok"


def test_cuda_platform_is_skipped():
    r = _result(CUDA_CHILD, "cuda")
    assert r["state"] == "skipped"
    assert "platform cuda" in r["reason"]


@pytest.mark.npu
def test_npu_layer_forward_on_ascend():
    """On a real Ascend host: a patched layer's QK path runs on the NPU and matches the CPU eager result."""
    code = r"""
import json, torch, torch_npu
from drama3_patches.kernels.qk_norm_rope_gate import qk_norm_rope_gate
g = torch.Generator().manual_seed(0)
qkv = torch.randn(8, 2 * 4 * 256 + 2 * 2 * 256, generator=g).bfloat16()
pos = torch.randint(0, 4096, (8,), generator=g)
w = torch.randn(256, generator=g) * 0.3
t = torch.arange(4096, dtype=torch.float)
inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
f = torch.outer(t, inv); cache = torch.cat((f.cos(), f.sin()), dim=-1)
kw = dict(num_heads=4, num_kv_heads=2, head_dim=256, rotary_dim=64, eps=1e-6)
cpu = qk_norm_rope_gate(qkv, pos, w, w, cache, **kw)
npu = qk_norm_rope_gate(qkv.npu(), pos.npu(), w.npu(), w.npu(), cache.npu(), **kw)
err = max(float((a.float() - b.cpu().float()).abs().max()) for a, b in zip(cpu, npu))
print("RESULT" + json.dumps({"err": err}))
"""
    r = _result(code, "npu")
    assert r["err"] <= 2 ** -6  # bf16: one rounding step at |x| ~ 4
