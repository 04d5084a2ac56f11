"""tower-sampler-eager on the Drama 3 kernel entry points (tier 3 replica + tier 4 fake NPU).

The replica (tests/replicas/omni_030/vllm_omni/model_executor/models/fish_omni/)
models the port's ``kernels`` module, whose entry points launch Triton and so
fail on non-CUDA tensors, and an ``audio_tower`` module that binds them with
``from .kernels import ...``.  Children apply the patch as an Ascend host
would; the eager results are checked against ``drama3_patches.kernels``
directly (the kernels themselves are checked against vLLM in
tests/test_kernels_*.py).
"""

from __future__ import annotations

import inspect
import json
import logging

import pytest

from support.replicas import OMNI_030, profile_paths
from support.subproc import run_python

PATCH = "tower-sampler-eager"

PRELUDE = r"""
import json, torch
import drama3_patches
KMOD = "vllm_omni.model_executor.models.fish_omni.kernels"
def state():
    return next(p for p in drama3_patches.status()["patches"] if p["id"] == "tower-sampler-eager")
out = {}
"""

NPU_CHILD = PRELUDE + r"""
drama3_patches.apply()
import vllm_omni.model_executor.models.fish_omni.kernels as K
from vllm_omni.model_executor.models.fish_omni import audio_tower
from drama3_patches.kernels import norms, gating, sampling, qk_norm_rope_gate as qkmod
out["state"] = state()["state"]
out["targets"] = len(state()["targets"])
out["alias_patched"] = audio_tower.gemma_rms_norm is K.gemma_rms_norm and \
    getattr(K.gemma_rms_norm, "__wrapped__", None) is not None

g = torch.Generator().manual_seed(0)
x = torch.randn(5, 64, generator=g).bfloat16(); w = torch.randn(64, generator=g) * 0.1
r = torch.randn(5, 64, generator=g).bfloat16()
checks = {}
checks["norm"] = torch.equal(K.gemma_rms_norm(x, w, 1e-6), norms.gemma_rms_norm(x, w, 1e-6))
a, b = K.gemma_rms_norm(x, w, 1e-6, r), norms.gemma_rms_norm(x, w, 1e-6, r)
checks["norm_residual"] = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
checks["gate"] = torch.equal(K.sigmoid_gate(x, r), gating.sigmoid_gate(x, r))
table = torch.randn(3 * 4096, 64, generator=g)
codes = torch.randint(0, 4096, (7, 3), generator=g)
checks["embed"] = torch.equal(K.tower_embed_norm(codes, table, w, 1e-6, 4096),
                              norms.tower_embed_norm(codes, table, w, 1e-6, 4096))
qkv = torch.randn(4, 2 * 2 * 64 + 2 * 64, generator=g).bfloat16()
pos = torch.arange(4); cache = torch.randn(128, 16, generator=g)
kw = dict(num_heads=2, num_kv_heads=1, head_dim=64, rotary_dim=16, eps=1e-6)
checks["qk"] = all(torch.equal(u, v) for u, v in zip(K.qk_norm_rope_gate(qkv, pos, w, w, cache, **kw),
                                                       qkmod.qk_norm_rope_gate(qkv, pos, w, w, cache, **kw)))
logits = torch.randn(8, 4096, generator=g)
id_map = torch.arange(4096) + 151000
s1 = K.sample_frame_tokens(logits, 30, 0.9, 0.8, torch.Generator().manual_seed(3), id_map)
s2 = sampling.sample_top_k_top_p(logits, 30, 0.9, 0.8, torch.Generator().manual_seed(3), id_map)
checks["sample"] = torch.equal(s1, s2) and bool((s1 >= 151000).all())

# The model module reaches the eager path through the names it bound at import.
tower = audio_tower.FishOmniAudioTower()
emb = tower.embed_frames(torch.randint(0, 4096, (6, 4), generator=g))
checks["tower_embed"] = emb.shape == (6, 64)
ids = tower.sample(emb, torch.zeros_like(emb), 30, 0.9, 1.0, torch.Generator().manual_seed(1))
checks["tower_sample"] = ids.shape == (6,) and bool(((ids >= 0) & (ids < 4096)).all())
out["checks"] = checks
out["triton_calls_on_cpu"] = list(K.TRITON_CALLS)

class LooksCuda(torch.Tensor):  # is_cuda True without a GPU: the original must run
    @property
    def is_cuda(self):
        return True
out["cuda_dispatch"] = K.sigmoid_gate(x.as_subclass(LooksCuda), r.as_subclass(LooksCuda))
out["triton_calls"] = list(K.TRITON_CALLS)

original = drama3_patches.get_original(KMOD + ":gemma_rms_norm")
drama3_patches.unapply()
out["restored"] = K.gemma_rms_norm is original
try:
    K.gemma_rms_norm(x, w, 1e-6)
    out["unpatched_cpu"] = "ran"
except ValueError as exc:
    out["unpatched_cpu"] = str(exc)
print("RESULT" + json.dumps(out))
"""

LATE_CHILD = PRELUDE + r"""
from vllm_omni.model_executor.models.fish_omni import audio_tower   # binds the originals first
import vllm_omni.model_executor.models.fish_omni.kernels as K
drama3_patches.apply()
out["state"] = state()["state"]
out["alias_rebound"] = audio_tower.sample_frame_tokens is K.sample_frame_tokens
logits = torch.randn(3, 4096)
out["runs"] = audio_tower.sample_frame_tokens(logits, 30, 0.9, 1.0).shape[0]
print("RESULT" + json.dumps(out))
"""

CUDA_CHILD = PRELUDE + r"""
drama3_patches.apply()
import vllm_omni.model_executor.models.fish_omni.kernels as K
out["state"] = state()["state"]
out["reason"] = state()["reason"]
out["untouched"] = not hasattr(K.gemma_rms_norm, "__wrapped__")
print("RESULT" + json.dumps(out))
"""

FAKE_NPU_CHILD = r"""
import json, torch
from support import fake_npu
fake_npu.enable()
import drama3_patches
drama3_patches.apply()
import vllm_omni.model_executor.models.fish_omni.kernels as K
from drama3_patches.kernels import norms, sampling
g = torch.Generator().manual_seed(0)
x = torch.randn(5, 64, generator=g).bfloat16(); w = torch.randn(64, generator=g) * 0.1
logits = torch.randn(4, 4096, generator=g)
out = {}
y = K.gemma_rms_norm(fake_npu.to_npu(x), fake_npu.to_npu(w), 1e-6)
out["norm_device"] = y.device.type
out["norm_equal"] = torch.equal(y.cpu(), norms.gemma_rms_norm(x, w, 1e-6))
k = torch.tensor([1, 5, 30, 4096])
s = K.sample_frame_tokens(fake_npu.to_npu(logits), fake_npu.to_npu(k), 0.9, 1.0)
out["sample_device"] = s.device.type
kept = ~torch.isinf(sampling.top_k_top_p_filter(logits, k, 0.9))
out["sample_kept"] = bool(kept.gather(1, s.cpu().unsqueeze(1)).all())
greedy = K.sample_frame_tokens(fake_npu.to_npu(logits), None, None, 0.0)
out["greedy"] = torch.equal(greedy.cpu(), logits.argmax(-1))
print("RESULT" + json.dumps(out))
"""


def _result(code, platform, extra_paths=()):
    env = {"DRAMA3_PATCHES_PLATFORM": platform}
    proc = run_python(code, env=env, pythonpath=[*profile_paths(OMNI_030), *extra_paths], timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def test_npu_entry_points_dispatch_to_eager_kernels():
    r = _result(NPU_CHILD, "npu")
    assert r["state"] == "applied" and r["targets"] == 5
    assert r["alias_patched"] is True
    assert r["checks"] == {k: True for k in r["checks"]} and len(r["checks"]) == 8
    assert r["triton_calls_on_cpu"] == [], "no Triton launch for CPU tensors"
    assert r["cuda_dispatch"] == "sigmoid_gate" and r["triton_calls"] == ["sigmoid_gate"]
    assert r["restored"] is True
    assert "cannot be accessed from Triton" in r["unpatched_cpu"]


def test_late_start_rebinds_names_the_model_imported():
    r = _result(LATE_CHILD, "npu")
    assert r["state"] == "applied"
    assert r["alias_rebound"] is True
    assert r["runs"] == 3


def test_cuda_platform_is_skipped():
    r = _result(CUDA_CHILD, "cuda")
    assert r["state"] == "skipped" and "platform cuda" in r["reason"]
    assert r["untouched"] is True


def test_fake_npu_tensors_stay_on_the_device():
    from support.subproc import ROOT

    r = _result(FAKE_NPU_CHILD, "npu", extra_paths=[ROOT / "tests"])
    assert r == {"norm_device": "npu", "norm_equal": True, "sample_device": "npu",
                 "sample_kept": True, "greedy": True}


def test_kernel_is_chosen_by_signature_and_a_mismatch_fails_with_names():
    from drama3_patches.kernels.norms import gemma_rms_norm
    from drama3_patches.patches import tower_sampler_eager as patch
    from drama3_patches.patchlib import PatchContext

    def renamed_norm(x, weight, eps, residual=None):  # another build's name, same signature
        raise AssertionError("not called")

    def unknown(x, scale):
        raise AssertionError("not called")

    assert patch.kernel_for(renamed_norm) is gemma_rms_norm
    assert patch.kernel_for(unknown) is None
    ctx = PatchContext(patch_id=PATCH, targets=("m:unknown",), platform="npu", versions={},
                       logger=logging.getLogger("t"), _resolve=lambda t: unknown)
    with pytest.raises(TypeError, match=r"m:unknown\(x, scale\) matches no eager kernel"):
        patch.plan(ctx)
    ctx = PatchContext(patch_id=PATCH, targets=("m:renamed_norm",), platform="npu", versions={},
                       logger=logging.getLogger("t"), _resolve=lambda t: renamed_norm)
    replacement = patch.plan(ctx)["m:renamed_norm"]
    assert replacement.__wrapped__ is renamed_norm
    assert inspect.signature(replacement) == inspect.signature(renamed_norm)


@pytest.mark.npu
def test_sampler_on_ascend_matches_cpu_kept_set():
    """On a real Ascend host: the sampler runs on NPU tensors and samples inside the CPU kept set."""
    code = r"""
import json, torch, torch_npu
from drama3_patches.kernels.sampling import sample_top_k_top_p, top_k_top_p_filter
logits = torch.randn(64, 151936) * 3
k = torch.full((64,), 30)
ids = sample_top_k_top_p(logits.npu(), k.npu(), 0.9, 1.0).cpu()
kept = ~torch.isinf(top_k_top_p_filter(logits, k, 0.9))
print("RESULT" + json.dumps({"ok": bool(kept.gather(1, ids.unsqueeze(1)).all())}))
"""
    assert _result(code, "npu") == {"ok": True}
