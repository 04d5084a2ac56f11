"""tower-sampler-eager on the published fish_omni code (tier 3) and the simulated npu device (tier 4).

The children import vllm-omni 0.32.0rc1's real ``fish_omni`` modules
(``kernels``, ``codebook_tower``, ``sampling``) and vLLM's
``fused_qk_norm_rope`` after ``support.triton_interpret.enable()``, so the
originals are the published Triton kernels, runnable on CPU by Triton's
interpreter (rounding float32 to bfloat16 as the GPU does).  Then, on the
simulated npu device with every Triton launch made to raise
(``triton_interpret.no_launch``):

* a real ``codebook_tower.TowerLayer`` forward, both variants (the folded
  code table through ``gemma_rms_norm_table``, and ``tower_mix_norm`` with the
  extra embedding), plus ``finalize_weights`` building the code table on the
  device;
* ``sampling.FusedFrameSampler.main_tokens`` (first and RAS draws) and
  ``.code`` for every head;

and compare with the same calls on CPU through the published kernels (same
weights, inputs and noise).  The layer's vLLM ``Attention`` needs vLLM's
forward context and an attention backend, so the children build the layers
with a small eager causal attention in its place (on an Ascend host the
attention is vLLM-Ascend's); everything else in the layer is the published
code.  Two activation paths: the patch active before the model modules are
imported (``DRAMA3_PATCHES=1``: the import trigger patches a kernels module
before ``codebook_tower``/``sampling`` bind its names) and a late start
(``drama3_patches.apply()`` after they bound the originals: the engine's
alias audit rebinds them).
"""

from __future__ import annotations

import inspect
import logging

import pytest

from support.replicas import needs_fish_omni
from support.subproc import call

pytestmark = pytest.mark.vllm

PATCH = "tower-sampler-eager"

KMOD = "vllm_omni.model_executor.models.fish_omni.kernels"
QKMOD = "vllm.model_executor.layers.fused_qk_norm_rope"
TARGETS = [f"{KMOD}:{n}" for n in ("tower_mix_norm", "gemma_rms_norm", "gemma_rms_norm_table", "sigmoid_gate",
                                   "draw_top_k_top_p")] + [f"{QKMOD}:fused_qk_rmsnorm_rope_gate"]

def tower_sampler_child(mode: str) -> dict:
    """``mode``: "before-import" (started with the engine on: the start-up hook patches the kernels
    module before codebook_tower/sampling bind its names) or "late-start" (applied afterwards)."""
    import copy
    from support import fake_npu, triton_interpret
    triton_interpret.enable()           # the published kernels run, interpreted, on CPU tensors
    import torch
    from torch import nn
    import drama3_patches

    NPU = fake_npu.DEVICE
    out = {"mode": mode}

    def state():
        return next(p for p in drama3_patches.status()["patches"] if p["id"] == "tower-sampler-eager")

    import vllm_omni.model_executor.models.fish_omni.kernels as K
    import vllm.model_executor.layers.fused_qk_norm_rope as FQ
    from vllm_omni.model_executor.models.fish_omni import codebook_tower as ct, sampling as sm
    from vllm_omni.model_executor.models.fish_omni.configuration_fish_omni import FishOmniAudioDecoderConfig
    from vllm.config import CompilationConfig, DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode
    # After the imports: with a torch.npu present, vllm-omni would pick its NPU platform (vllm-ascend).
    fake_npu.enable()

    BOUND = {  # the names the model modules call, as bound by `from ... import`
        "tower_mix_norm": (ct, K), "gemma_rms_norm": (ct, K), "gemma_rms_norm_table": (ct, K),
        "sigmoid_gate": (ct, K), "draw_top_k_top_p": (sm, K), "fused_qk_rmsnorm_rope_gate": (ct, FQ),
    }

    def bindings():
        res = {}
        for name, (user, home) in BOUND.items():
            f = getattr(user, name)
            res[name] = {"same_as_home": f is getattr(home, name),
                         "wrapped": getattr(f, "__wrapped__", None) is not None,
                         "kernel": getattr(f, "__drama3_eager_kernel__", None)}
        return res

    out["before"] = {"state": state()["state"], "bindings": bindings(),
                     "aliases": {t: s["aliases"] for t, s in state()["target_states"].items()}}


    class EagerCausalAttention(nn.Module):
        """Test stand-in for vLLM's Attention: causal attention over the whole (single) sequence."""

        def __init__(self, num_heads, head_size, scale, num_kv_heads=None, cache_config=None, prefix=""):
            super().__init__()
            self.heads, self.head_size, self.scale = num_heads, head_size, scale
            self.kv_heads = num_kv_heads or num_heads

        def forward(self, q, k, v):
            t, rep = q.shape[0], self.heads // self.kv_heads
            q = q.view(t, self.heads, self.head_size).transpose(0, 1).float()
            k = k.view(t, self.kv_heads, self.head_size).transpose(0, 1).repeat_interleave(rep, 0).float()
            v = v.view(t, self.kv_heads, self.head_size).transpose(0, 1).repeat_interleave(rep, 0).float()
            scores = (q @ k.transpose(1, 2)) * self.scale
            future = torch.ones(t, t, dtype=torch.bool).triu(1).to(scores.device)
            probs = scores.masked_fill(future, float("-inf")).softmax(-1)
            return (probs @ v).to(torch.bfloat16).transpose(0, 1).reshape(t, self.heads * self.head_size)


    ct.Attention = EagerCausalAttention
    cfg = FishOmniAudioDecoderConfig(dim=48, n_head=3, n_local_heads=1, head_dim=32, intermediate_size=40, vocab_size=11)
    g = torch.Generator().manual_seed(7)
    vconf = VllmConfig(device_config=DeviceConfig(device="cpu"),
                       compilation_config=CompilationConfig(mode=CompilationMode.NONE, custom_ops=["none"]))
    torch.set_default_dtype(torch.bfloat16)  # as vLLM builds a bf16 model
    with set_current_vllm_config(vconf):
        rotary = ct.TowerRotary(cfg, 64)
        raw = {v: ct.TowerLayer(cfg, rotary, None, f"tower.{v}", code_table=v) for v in (False, True)}
    torch.set_default_dtype(torch.float32)
    for layer in raw.values():
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
    T = 9
    inputs = dict(hidden=torch.randn(T, 48, generator=g).bfloat16(),
                  codes=torch.randint(-2, 14, (T,), generator=g),            # some outside the 11 codes
                  semantic=torch.rand(T, generator=g) > 0.3,
                  extra=torch.randn(T, 48, generator=g).bfloat16(),
                  positions=torch.arange(T) + 3)

    ROWS, CANDS, K_MAX, CODEBOOKS = 12, 40, 16, 4
    sampler_in = dict(candidate_logits=torch.randn(ROWS, CANDS, generator=g) * 2,
                      candidate_ids=torch.arange(CANDS) + 100,
                      temperature=torch.rand(ROWS, generator=g) + 0.3,
                      top_k=torch.randint(1, K_MAX + 4, (ROWS,), generator=g),
                      top_p=torch.rand(ROWS, generator=g) * 0.6 + 0.4,
                      noise=torch.rand(ROWS, CODEBOOKS + 1, K_MAX, generator=g),
                      head_logits=torch.randn(CODEBOOKS - 1, ROWS, 24, generator=g) * 2)  # codebook heads: >= max_top_k columns
    sampler_in["temperature"][0] = 0.0
    # Windows holding each row's likeliest candidates, so first draws repeat and the RAS draw is taken.
    likely = sampler_in["candidate_logits"].topk(16, dim=-1).indices + 100
    sampler_in["ras_window"] = torch.where(torch.arange(ROWS).unsqueeze(1) % 2 == 0, likely, torch.full_like(likely, -1))


    def finalized(layer):
        layer = copy.deepcopy(layer)
        layer.finalize_weights()
        return layer


    def to_npu(layer):
        layer = copy.deepcopy(layer).to(NPU)
        if layer.code_table is not None:
            layer.code_table = layer.code_table.to(NPU)
        return layer


    def run_tower(layers, device):
        res = {}
        with torch.no_grad():
            for variant, layer in layers.items():
                x = {k: v.to(device) for k, v in inputs.items()}
                res[variant] = layer(x["hidden"], x["codes"], x["semantic"], None if variant else x["extra"], x["positions"])
        return res


    def run_sampler(device):
        sampler = sm.FusedFrameSampler(max_top_k=K_MAX, num_codebooks=CODEBOOKS, max_rows=ROWS, device=device)
        x = {k: v.to(device) for k, v in sampler_in.items()}
        main, code_zero = sampler.main_tokens(x["candidate_logits"], x["candidate_ids"], x["ras_window"], x["temperature"],
                                              x["top_k"], x["top_p"], x["noise"], 100, CANDS - 3)
        codes = [sampler.code(x["head_logits"][h], x["temperature"], x["top_k"], x["top_p"], x["noise"], h)
                 for h in range(CODEBOOKS - 1)]
        # the sampler's own first draw, to count the rows where the RAS draw replaced it
        first = sm.draw_top_k_top_p(x["candidate_logits"], x["temperature"], x["top_k"], x["top_p"], x["noise"][:, 0],
                                    K_MAX, x["candidate_ids"])
        return {"main": main, "code_zero": code_zero, "codes": torch.stack(codes), "first": first}


    def cpu_reference():
        # The published kernels (interpreted); launches allowed.
        assert not triton_interpret.launches_blocked()
        return run_tower(cpu_layers, "cpu"), run_sampler("cpu")


    with set_current_vllm_config(vconf):
        cpu_layers = {v: finalized(layer) for v, layer in raw.items()}
        if mode == "late-start":
            reference = cpu_reference()
            drama3_patches.apply()
            out["late"] = {"state": state()["state"], "bindings": bindings(),
                           "aliases": {t: s["aliases"] for t, s in state()["target_states"].items()}}

        # ---- on the simulated npu, with every Triton launch raising -------------------------------
        npu_layers = {v: to_npu(layer) for v, layer in cpu_layers.items()}
        with triton_interpret.no_launch():
            npu_tower = run_tower(npu_layers, NPU)
            npu_sampler = run_sampler(NPU)
            on_device = to_npu(raw[True])
            on_device.finalize_weights()      # build_code_table's gemma_rms_norm on the device
            # positive controls: the guard does fire, and a CUDA tensor reaches the original kernel
            controls = {}
            x = torch.randn(3, 8, generator=g)
            try:
                drama3_patches.get_original(TARGETS[3])(x, x)
                controls["original_on_cpu"] = "ran"
            except triton_interpret.TritonLaunch:
                controls["original_on_cpu"] = "launch blocked"

            class LooksCuda(torch.Tensor):
                @property
                def is_cuda(self):
                    return True

            try:
                K.sigmoid_gate(x.as_subclass(LooksCuda), x.as_subclass(LooksCuda))
                controls["cuda_tensor"] = "eager"
            except triton_interpret.TritonLaunch:
                controls["cuda_tensor"] = "original (launch blocked)"
        out["controls"] = controls
        out["devices"] = sorted({t.device.type for t in [*npu_tower.values(), *npu_sampler.values(), on_device.code_table]})
        out["npu_is_fake"] = all(fake_npu.is_fake_npu(t) for t in [*npu_tower.values(), *npu_sampler.values()])

        if mode == "before-import":
            originals = {t: drama3_patches.get_original(t) for t in TARGETS}
            drama3_patches.unapply()
            homes = {name: home for name, (user, home) in BOUND.items()}
            out["after_unapply"] = {"bindings": bindings(), "restored": [
                getattr(homes[t.rsplit(":", 1)[1]], t.rsplit(":", 1)[1]) is originals[t] for t in TARGETS]}
            reference = cpu_reference()

    ref_tower, ref_sampler = reference
    def bf16_diff(a, b):
        a, b = a.cpu(), b.cpu()
        return {"equal": bool(torch.equal(a, b)), "max_abs": float((a.float() - b.float()).abs().max()),
                "ne": int((a != b).sum()), "n": a.numel()}
    out["tower"] = {str(v): bf16_diff(npu_tower[v], ref_tower[v]) for v in (False, True)}
    out["code_table"] = bf16_diff(on_device.code_table, cpu_layers[True].code_table)
    out["sampler"] = {k: bool(torch.equal(npu_sampler[k].cpu(), ref_sampler[k])) for k in ref_sampler}
    out["ras_rows"] = int((ref_sampler["main"] != ref_sampler["first"]).sum())
    out["distinct_main"] = int(ref_sampler["main"].unique().numel())
    return out


def _child(mode):
    # A fresh interpreter: the start-up hook (before-import) and Triton's interpreter both need to
    # act before any module with Triton kernels is imported, which the test process may have done.
    env = {"DRAMA3_PATCHES_PLATFORM": "npu"}
    if mode == "before-import":
        env["DRAMA3_PATCHES"] = "1"
    return call(tower_sampler_child, mode, env=env, timeout=600)


def _assert_bound_to_wrappers(bindings):
    for name, b in bindings.items():
        assert b["same_as_home"] and b["wrapped"], (name, b)
        assert b["kernel"].startswith("drama3_patches.kernels."), (name, b)


def _assert_npu_results(r):
    # No Triton launch was reached on the device (it would have raised), and the guard works:
    assert r["controls"] == {"original_on_cpu": "launch blocked", "cuda_tensor": "original (launch blocked)"}
    assert r["devices"] == ["npu"] and r["npu_is_fake"] is True
    assert r["sampler"] == {"main": True, "code_zero": True, "codes": True, "first": True}, r["sampler"]
    assert r["distinct_main"] >= 4 and r["ras_rows"] >= 1, r
    for variant, d in r["tower"].items():
        assert d["equal"], (variant, d)
    assert r["code_table"]["equal"], r["code_table"]


@needs_fish_omni
def test_active_before_import_on_npu_matches_the_published_kernels():
    r = _child("before-import")
    assert r["before"]["state"] == "applied"
    _assert_bound_to_wrappers(r["before"]["bindings"])
    # the importers bound the wrappers themselves: nothing was left for the alias audit to rebind
    assert r["before"]["aliases"] == {t: [] for t in TARGETS}, r["before"]["aliases"]
    _assert_npu_results(r)
    # unapply restores the published functions, also where codebook_tower/sampling bound them
    assert all(r["after_unapply"]["restored"]), r["after_unapply"]
    for name, b in r["after_unapply"]["bindings"].items():
        assert b["same_as_home"] and not b["wrapped"], (name, b)


@needs_fish_omni
def test_late_start_rebinds_the_model_modules_names():
    r = _child("late-start")
    assert r["before"]["state"] != "applied"
    for name, b in r["before"]["bindings"].items():
        assert b["same_as_home"] and not b["wrapped"], (name, b)   # the originals, bound at import
    assert r["late"]["state"] == "applied"
    _assert_bound_to_wrappers(r["late"]["bindings"])
    aliases = r["late"]["aliases"]
    assert "vllm_omni.model_executor.models.fish_omni.sampling.draw_top_k_top_p" in aliases[TARGETS[4]]
    assert "vllm_omni.model_executor.models.fish_omni.codebook_tower.fused_qk_rmsnorm_rope_gate" in aliases[TARGETS[5]]
    _assert_npu_results(r)


# ---- plan() on its own: kernels by name, signatures, feature detection ------------------------


def _ctx(targets, resolve):
    from drama3_patches.patchlib import PatchContext

    return PatchContext(patch_id=PATCH, targets=tuple(targets), platform="npu", versions={},
                        logger=logging.getLogger("t"), _resolve=resolve)


def test_a_target_that_no_longer_fits_fails_naming_both():
    from drama3_patches.patches import tower_sampler_eager as patch

    def gemma_rms_norm(x, weight, eps, residual=None, out=None):  # a new parameter upstream
        raise AssertionError("not called")

    def draw_top_k_top_p(logits, temperature, top_k, top_p, uniform, max_top_k, id_map=None, top=None,
                         min_temperature=1e-4):  # another default
        raise AssertionError("not called")

    def scale_rows(x, scale):
        raise AssertionError("not called")

    for target, func, pattern in (
        ("m:gemma_rms_norm", gemma_rms_norm,
         r"m:gemma_rms_norm\(x, weight, eps, residual=None, out=None\) no longer fits its eager kernel "
         r"drama3_patches\.kernels\.norms:gemma_rms_norm\(x, weight, eps, residual=None\)$"),
        ("m:draw_top_k_top_p", draw_top_k_top_p, r"min_temperature=0\.0001\) no longer fits .*min_temperature=1e-05"),
        ("m:scale_rows", scale_rows, r"m:scale_rows: no eager kernel is named 'scale_rows'"),
    ):
        with pytest.raises(TypeError, match=pattern):
            patch.plan(_ctx([target], lambda t, f=func: f))


FAKE_UPSTREAM = '''
import torch
import triton
from drama3_patches.kernels import gating

@triton.jit
def _gate_kernel(x_ptr, n):
    pass

def _launch(x, gate):
    out = torch.empty_like(x)
    _gate_kernel[(1,)](x, x.numel())
    return out

def sigmoid_gate(x, gate):
    {body}
'''


@pytest.mark.parametrize("body, needed", [
    # dispatches every non-CUDA tensor itself: the fix the patch waits for
    ("if not x.is_cuda:\n        return gating.sigmoid_gate(x, gate)\n    return _launch(x, gate)", False),
    # a CPU-only fallback still launches Triton for an NPU tensor
    ("if x.device.type == 'cpu':\n        return gating.sigmoid_gate(x, gate)\n    return _launch(x, gate)", True),
    # the published shape: always launches (here through a helper of the module)
    ("return _launch(x, gate)", True),
    # fails off CUDA without launching: still needs the patch
    ("if not x.is_cuda:\n        raise NotImplementedError('CUDA only')\n    return _launch(x, gate)", True),
])
def test_feature_detection_probes_for_a_launch_off_cuda(tmp_path, body, needed):
    import importlib.util

    pytest.importorskip("triton")
    from drama3_patches.patches import tower_sampler_eager as patch

    path = tmp_path / "fake_fish_kernels.py"
    path.write_text(FAKE_UPSTREAM.replace("{body}", body))
    spec = importlib.util.spec_from_file_location("fake_fish_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not put in sys.modules: nothing global changes
    ctx = _ctx(["fake_fish_kernels:sigmoid_gate"], lambda t: module.sigmoid_gate)
    planned = patch.plan(ctx)
    if needed:
        assert list(planned) == ["fake_fish_kernels:sigmoid_gate"] and ctx.left == {}
        assert planned["fake_fish_kernels:sigmoid_gate"].__wrapped__ is module.sigmoid_gate
    else:
        assert planned == {}
        assert ctx.left["fake_fish_kernels:sigmoid_gate"].startswith("upstream fix detected: sigmoid_gate runs on")
    assert isinstance(module._gate_kernel, __import__("triton").runtime.jit.KernelInterface)  # untouched


def published_plan_child() -> dict:
    """plan() on the published functions, made real (interpreted) Triton kernels first."""
    import importlib
    from support import triton_interpret
    triton_interpret.enable()   # the published kernels become real (interpreted) Triton kernel objects
    from drama3_patches.patches import tower_sampler_eager as patch
    from drama3_patches.patchlib import PatchContext

    targets = TARGETS
    def resolve(t):
        module, name = t.split(":")
        return getattr(importlib.import_module(module), name)

    probes = {}
    for t in targets:
        name = t.split(":")[1]
        probe = patch._probe_copy(resolve(t))
        try:
            for args in patch._probe_calls(name):
                probe(*args)
            probes[name] = "returned"
        except patch._Launch as launch:
            probes[name] = "launch " + str(launch)
    ctx = PatchContext(patch_id="tower-sampler-eager", targets=tuple(targets), platform="npu", versions={},
                       logger=logging.getLogger("t"), _resolve=resolve)
    plan = patch.plan(ctx)
    out = {t: {"kernel": r.__drama3_eager_kernel__, "wrapped": r.__wrapped__ is resolve(t),
               "signature": inspect.signature(r) == inspect.signature(resolve(t)),
               "qualname": r.__qualname__ == resolve(t).__qualname__} for t, r in plan.items()}
    return {"probes": probes, "plan": out, "left": ctx.left}


@needs_fish_omni
def test_published_targets_launch_triton_off_cuda_and_get_their_kernels():
    """plan() on the published functions: each launches its Triton kernel for a non-CUDA tensor (so it is
    needed) and gets the eager kernel of its name, with its signature, name and ``__wrapped__``."""
    from drama3_patches.patches import tower_sampler_eager as patch

    # A fresh interpreter: Triton's interpreter must be on before the kernel modules import.
    r = call(published_plan_child, timeout=300)
    assert r["probes"] == {
        "tower_mix_norm": "launch _mix_norm_kernel",
        "gemma_rms_norm": "launch _gemma_norm_kernel",
        "gemma_rms_norm_table": "launch _table_norm_kernel",
        "sigmoid_gate": "launch _sigmoid_gate_kernel",
        "draw_top_k_top_p": "launch _draw_kernel",
        "fused_qk_rmsnorm_rope_gate": "launch _fused_qk_rmsnorm_rope_gate_kernel",
    }
    assert r["left"] == {}
    assert sorted(r["plan"]) == sorted(TARGETS)
    for target, info in r["plan"].items():
        assert info["kernel"] == patch.KERNELS[target.rsplit(":", 1)[1]], (target, info)
        assert info["wrapped"] and info["signature"] and info["qualname"], (target, info)


def test_eager_kernels_pass_their_own_probe():
    """The eager kernels run on meta tensors: an upstream that dispatched to them would read not-needed."""
    import pkgutil

    from drama3_patches.patches import tower_sampler_eager as patch

    for name, path in patch.KERNELS.items():
        assert patch.upstream_dispatch(name, pkgutil.resolve_name(path)) is not None, name


def test_dispatch_by_device_and_introspection():
    import torch

    from drama3_patches.kernels import gating
    from drama3_patches.patches import tower_sampler_eager as patch

    calls = []

    def sigmoid_gate(x, gate):  # stands in for a Triton entry point: fails off CUDA
        if not x.is_cuda:
            raise RuntimeError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        calls.append("original")
        return x

    class LooksCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    replacement = patch.plan(_ctx(["m:sigmoid_gate"], lambda t: sigmoid_gate))["m:sigmoid_gate"]
    assert replacement.__wrapped__ is sigmoid_gate and replacement.__name__ == "sigmoid_gate"
    assert inspect.signature(replacement) == inspect.signature(sigmoid_gate)
    x, gate = torch.randn(3, 5), torch.randn(3, 5)
    assert torch.equal(replacement(x, gate), gating.sigmoid_gate(x, gate)) and calls == []
    assert torch.equal(replacement(gate=gate, x=x), gating.sigmoid_gate(x, gate)) and calls == []
    replacement(x.as_subclass(LooksCuda), gate.as_subclass(LooksCuda))
    assert calls == ["original"]
