"""qwen3next-eager-attention on the real vLLM ``Qwen3NextAttention`` (tier 2).

Each test runs a fresh interpreter (the patch changes a real class).  A CPU
host's platform check answers "not CUDA", so the child makes vLLM's check say
CUDA (``qwen3_next.current_platform.is_cuda`` -> True) -- the situation the
patch exists for: without the patch such a layer selects the fused Triton
kernel (the cuda test shows it), with it the layer runs the eager path.  Layers
are built with a TP=1 gloo group and a CPU ``VllmConfig``; only the attention
backend object is replaced (choosing a CPU backend needs a full model config,
and the QK path never touches it).
"""

from __future__ import annotations

import json

import pytest

from support.subproc import run_python

pytestmark = pytest.mark.vllm

TARGET = "vllm.model_executor.models.qwen3_next:Qwen3NextAttention.__init__"

PRELUDE = r"""
import json, os, tempfile, torch
import drama3_patches
drama3_patches.apply()          # import triggers first: qwen3_next is patched when imported
from transformers import Qwen3NextConfig
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
import vllm.model_executor.models.qwen3_next as qn

class NoBackendAttention(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()

qn.Attention = NoBackendAttention

class SaysCuda:  # vLLM's platform check answering CUDA, as a shimmed Ascend process may
    def __init__(self, real):
        self._real = real
    def __getattr__(self, name):
        return getattr(self._real, name)
    def is_cuda(self):
        return True

qn.current_platform = SaysCuda(qn.current_platform)
CFG = Qwen3NextConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                      partial_rotary_factor=0.25, max_position_embeddings=4096, rms_norm_eps=1e-6)
CTX = set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu")))
CTX.__enter__()
init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                             distributed_init_method="file://" + tempfile.mktemp())
initialize_model_parallel(1, 1)

def build(cls=None, prefix="model.layers.3.self_attn"):
    torch.set_default_dtype(torch.bfloat16)
    try:
        return (cls or qn.Qwen3NextAttention)(CFG, prefix=prefix)
    finally:
        torch.set_default_dtype(torch.float32)

def state(patch_id="qwen3next-eager-attention"):
    return next(p for p in drama3_patches.status()["patches"] if p["id"] == patch_id)

out = {}
"""

NPU_CHILD = PRELUDE + r"""
from drama3_patches.kernels.qk_norm_rope_gate import qk_norm_rope_gate
from drama3_patches.patches.qwen3next_eager_attention import EagerPathError, is_eager_class
cls = qn.Qwen3NextAttention
original = drama3_patches.get_original(TARGET)
out["state"] = state()["state"]
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

# A subclass whose flag cannot be cleared is refused, naming the layer.
class StuckFused(cls):
    use_fused_qk_norm_rope_gate = property(lambda self: True, lambda self, value: None)
try:
    build(StuckFused, prefix="model.layers.7.self_attn")
    out["refused"] = None
except EagerPathError as exc:
    out["refused"] = str(exc)

# Idempotent: applying again and reloading the module keep one layer of wrapping.
drama3_patches.apply()
import importlib
qn2 = importlib.reload(qn)
out["after_reload_state"] = state()["state"]
out["after_reload_one_layer"] = not hasattr(qn2.Qwen3NextAttention.__init__.__wrapped__, "__wrapped__")
out["after_reload_marker"] = is_eager_class(qn2.Qwen3NextAttention)

drama3_patches.unapply()
init = qn2.Qwen3NextAttention.__init__
out["restored"] = not is_eager_class(qn2.Qwen3NextAttention) and not hasattr(init, "__wrapped__")
qn2.Attention = NoBackendAttention                      # the reload rebound both names
qn2.current_platform = SaysCuda(qn2.current_platform)
plain = build(qn2.Qwen3NextAttention)
out["unpatched_fused"] = plain.use_fused_qk_norm_rope_gate
plain_params = {k: (tuple(v.shape), str(v.dtype), hasattr(v, "weight_loader"))
                for k, v in plain.named_parameters()}
out["same_params"] = plain_params == patched_params and len(plain_params) > 0
print("RESULT" + json.dumps(out))
""".replace("TARGET", repr(TARGET))

CUDA_CHILD = PRELUDE + r"""
out["state"] = state()["state"]
out["reason"] = state()["reason"]
out["fused"] = build().use_fused_qk_norm_rope_gate
print("RESULT" + json.dumps(out))
"""

PORT_MARKER_CHILD = r"""
import json
import vllm.model_executor.models.qwen3_next as qn
qn.Qwen3NextAttention._fish_omni_npu_eager = True   # the in-tree port's class marker
original = qn.Qwen3NextAttention.__init__
import drama3_patches
drama3_patches.apply()
p = next(p for p in drama3_patches.status()["patches"] if p["id"] == "qwen3next-eager-attention")
print("RESULT" + json.dumps({"state": p["state"], "reason": p["reason"],
                             "untouched": qn.Qwen3NextAttention.__init__ is original}))
"""


def _result(code, platform, enabled="1"):
    env = {"DRAMA3_PATCHES": enabled, "DRAMA3_PATCHES_PLATFORM": platform}
    proc = run_python(code, env=env, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def test_npu_every_layer_takes_the_eager_path():
    r = _result(NPU_CHILD, "npu")
    assert r["state"] == "applied"
    assert r["marker"] is True and r["wrapped_is_original"] is True
    assert r["fused"] is False
    assert r["eager_equal"] == [True, True, True, True]
    assert r["refused"] is not None and "model.layers.7.self_attn" in r["refused"]
    assert "use_fused_qk_norm_rope_gate=True" in r["refused"]
    assert r["after_reload_state"] == "applied"
    assert r["after_reload_one_layer"] is True and r["after_reload_marker"] is True
    assert r["restored"] is True
    # Without the patch the same construction selects the fused kernel...
    assert r["unpatched_fused"] is True
    # ...and the patched layer has exactly the same parameters and weight loaders.
    assert r["same_params"] is True


def test_cuda_platform_is_skipped_and_keeps_the_fused_kernel():
    r = _result(CUDA_CHILD, "cuda")
    assert r["state"] == "skipped"
    assert "platform cuda" in r["reason"]
    assert r["fused"] is True


def test_port_marker_means_not_needed():
    # Disabled at start-up (no .pth activation): the marker is set before apply().
    r = _result(PORT_MARKER_CHILD, "npu", enabled="0")
    assert r["state"] == "not-needed", r
    assert "_fish_omni_npu_eager" in r["reason"]
    assert r["untouched"] is True


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
