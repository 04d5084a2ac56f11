"""fish-omni-tensor-parallel and fish-omni-tower-tp-split on the published fish_omni (vllm-omni 0.32.0rc1).

* The constructor: the published refusal is what feature detection finds; patched, TP2 gets past
  it (the config reports its real size again afterwards, also when construction fails), pipeline
  parallel still meets upstream's message.
* Rank agreement through the engine-patched methods in a two-process gloo group: the real
  ``_reference_codes`` (rank 1 given other codes, or none, ends with rank 0's; rank 0's codes not
  a tensor: the same error on both ranks) and the real ``postprocess_model_output`` under
  ``DRAMA3_PATCHES_TP_CHECK=1`` (fish-omni-tp-frames-check: equal frames pass; a rank with
  another frame fails on every rank, naming the step and the rank; ``tp_steps_checked`` counts
  the steps compared).
* The KV layout: vLLM's ``get_kv_cache_configs`` on Drama 3's layer specs
  (``benchmarks/tower_kv_groups.py``): the split tower puts TP2 back at TP1's group count.
* Expert parallel: vLLM's EP weight filter reads fish_omni's expert count and skips the other
  rank's expert weights by name, before they are read.

The model module imports only with the e2e tier's PIL Qwen2-VL hook (``support.replicas``).
"""

from __future__ import annotations

import importlib.util

import pytest

from support.replicas import PIL_QWEN2VL_ENV, PIL_QWEN2VL_PATH, needs_fish_omni, npu_env
from support.subproc import ROOT, call, call_ranks

pytestmark = [pytest.mark.vllm, needs_fish_omni]

UPSTREAM_REFUSAL = "fish_omni runs with one tensor and pipeline rank"


def _env(**extra):
    return {**npu_env(DRAMA3_PATCHES_STRICT="1"), **PIL_QWEN2VL_ENV, **extra}


def constructor_child() -> dict:
    """The published constructor before and after the engine patches it, on probe configs."""
    from vllm_omni.model_executor.models.fish_omni import fish_omni_model as fm

    import drama3_patches
    from drama3_patches.patches import fish_omni_tensor_parallel as tp

    out = {"state": {p["id"]: p for p in drama3_patches.status()["patches"]}["fish-omni-tensor-parallel"]}
    init = fm.FishOmniForConditionalGeneration.__dict__["__init__"]
    out["original_refuses"] = tp.refuses_tp(drama3_patches.get_original(tp.INIT))
    out["patched_refuses"] = tp.refuses_tp(init)
    results = {}
    for size, pipeline in ((2, 1), (2, 2), (1, 2)):
        config = tp.probe_config(size, pipeline, enable_expert_parallel=True)
        parallel = config.parallel_config
        try:
            fm.FishOmniForConditionalGeneration(vllm_config=config)
            results[f"{size}x{pipeline}"] = "built"
        except tp._Past as exc:
            results[f"{size}x{pipeline}"] = f"past the check (stopped reading {exc})"
        except NotImplementedError as exc:
            results[f"{size}x{pipeline}"] = f"refused: {exc}"
        results[f"{size}x{pipeline} size after"] = parallel.tensor_parallel_size
    out["results"] = results

    def reads_another_field_first(self, *, vllm_config, prefix=""):
        vllm_config.parallel_config.data_parallel_size  # a read before any parallel check
        raise NotImplementedError("never reached")

    try:
        out["other_read"] = tp.refuses_tp(reads_another_field_first)
    except LookupError as exc:
        out["other_read"] = f"LookupError: {exc}"
    return out


def test_constructor_accepts_tp_and_keeps_pipeline_refusal():
    out = call(constructor_child, env=_env(), pythonpath=PIL_QWEN2VL_PATH, timeout=900)
    assert out["state"]["state"] == "applied", out["state"]
    assert out["original_refuses"] is True and out["patched_refuses"] is False
    r = out["results"]
    assert r["2x1"] == "past the check (stopped reading model_config.model)"  # the next line after the check
    assert r["2x1 size after"] == 2  # the real size is back once construction stops
    assert r["2x2"] == f"refused: {UPSTREAM_REFUSAL}" and r["1x2"] == f"refused: {UPSTREAM_REFUSAL}"


def test_probe_counts_only_the_model_path_as_past_the_check():
    """A constructor that stops on another unknown field is not taken for one that accepts TP."""
    out = call(constructor_child, env=_env(), pythonpath=PIL_QWEN2VL_PATH, timeout=900)
    assert out["other_read"] == ("LookupError: the constructor read parallel_config.data_parallel_size "
                                 "where the probe expected model_config.model")


TWO_MODULE_ENTRY = """\
patches:
  - id: fish-omni-tensor-parallel
    summary: the constructor's and the model state's targets in one patch
    targets:
      - vllm_omni.model_executor.models.fish_omni.fish_omni_model:FishOmniForConditionalGeneration.__init__
      - vllm_omni.model_executor.models.fish_omni.model_state:FishOmniModelState.postprocess_model_output
    requires: {}
    platforms: [npu]
    implementation: drama3_patches.patches.fish_omni_tensor_parallel:plan
    why: engine test
    how: engine test
    upstream: none
    remove_when: never
"""


def two_module_child() -> dict:
    """The model module first (its run applies __init__), then the model state: the shipped plan
    handles the model module's targets only, so its run on the state's target fails."""
    from vllm_omni.model_executor.models.fish_omni import fish_omni_model as fm

    import drama3_patches
    from drama3_patches.engine import get_engine

    def ours():
        return get_engine().is_ours(fm.FishOmniForConditionalGeneration.__dict__["__init__"])

    out = {"patched_after_model": ours() == "fish-omni-tensor-parallel"}
    from vllm_omni.model_executor.models.fish_omni import model_state  # noqa: F401

    st = drama3_patches.status()["patches"][0]
    out["patched_after_state"] = ours() is not None
    out["state"] = st["state"]
    return out


def test_a_failure_in_the_model_state_restores_the_constructor(tmp_path):
    """All or none across the two real modules: the plan run on model_state fails, so the
    constructor the model module's run patched is the original again."""
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(TWO_MODULE_ENTRY)
    out = call(two_module_child, env=_env(DRAMA3_PATCHES_STRICT="0", DRAMA3_PATCHES_MANIFEST=str(manifest)),
               pythonpath=PIL_QWEN2VL_PATH, timeout=900)
    assert out == {"patched_after_model": True, "patched_after_state": False, "state": "failed"}
    # (Before the engine restored earlier runs: {"patched_after_state": True} with "failed".)


def agreement_child(device: str = "cpu", backend: str = "gloo") -> dict:
    """One rank: the patched _reference_codes and postprocess_model_output, through the engine
    (``device``/``backend``: the sampled frames' device and the group's device backend)."""
    import torch

    from support.vllm_state import join_tp_group

    rank, _ = join_tp_group(backend=backend)
    from vllm_omni.model_executor.models.fish_omni import fish_omni_model as fm
    from vllm_omni.model_executor.models.fish_omni import model_state as ms

    import drama3_patches
    from types import SimpleNamespace

    states = {p["id"]: p["state"] for p in drama3_patches.status()["patches"]}
    model = object.__new__(fm.FishOmniForConditionalGeneration)
    own = torch.arange(12).reshape(4, 3) * (rank + 1)  # rank 1's encoder "disagrees"
    out = {"rank": rank, "states": states,
           "codes": model._reference_codes({"ref_codes": [own]}, torch.device("cpu")).tolist(),
           "none_on_rank0": model._reference_codes({"ref_codes": [own]} if rank else {}, torch.device("cpu"))}

    from drama3_patches.patches import fish_omni_tensor_parallel as tp

    try:  # rank 0's codes are a list, not a tensor: every rank must get the same error, none wait
        tp.broadcast_codes([[1, 2]] if rank == 0 else own, tp.tp_group())
        out["list_on_rank0"] = "returned"
    except ValueError as exc:
        out["list_on_rank0"] = f"ValueError: {exc}"

    state = object.__new__(ms.FishOmniModelState)
    state.buffers = SimpleNamespace(sampled_frames=torch.arange(33, device=device).reshape(3, 11))
    state._valid_rows, state._partitioned = [True, True, True], False
    batch = SimpleNamespace(num_reqs=3)
    hidden, snapshot = state.postprocess_model_output(torch.zeros(3, 4), batch, None)
    out["first_step"] = {"hidden": list(hidden.shape), "rows": len(snapshot["codes"]["audio"])}
    if rank == 1:
        state.buffers.sampled_frames[2, 5] += 1  # one code of one frame
    try:
        state.postprocess_model_output(torch.zeros(3, 4), batch, None)
        out["second_step"] = "passed"
    except Exception as exc:
        out["second_step"] = f"{type(exc).__name__}: {exc}"
    from drama3_patches.engine.state import counters

    out["steps_checked"] = counters().get("tp_steps_checked", 0)
    return out


def test_ranks_take_rank0_codes_and_frame_drift_fails_loudly():
    r0, r1 = call_ranks(agreement_child, 2, env=_env(DRAMA3_PATCHES_TP_CHECK="1"), pythonpath=PIL_QWEN2VL_PATH,
                        timeout=900)
    assert r0["states"]["fish-omni-tensor-parallel"] == r0["states"]["fish-omni-tp-frames-check"] == "applied"
    rank0_codes = [[3 * i + j for j in range(3)] for i in range(4)]
    assert r0["codes"] == r1["codes"] == rank0_codes  # rank 1 had twice these
    assert r0["none_on_rank0"] is None and r1["none_on_rank0"] is None  # rank 0 had none: none
    assert r0["list_on_rank0"] == r1["list_on_rank0"]
    assert r0["list_on_rank0"].startswith("ValueError: tensor-parallel rank 0's reference codes are not a tensor")
    assert r0["first_step"] == r1["first_step"] == {"hidden": [3, 4], "rows": 3}
    for run in (r0, r1):
        assert run["second_step"].startswith("TensorParallelDrift: step 1: ")
        assert "rank(s) [1] differ from rank 0's" in run["second_step"]
        assert "DRAMA3_PATCHES_TP_CHECK=1" in run["second_step"]
        assert run["steps_checked"] == 2  # both steps compared (the second one then raised)


def drift_fault_child() -> str:
    """One rank: one step of identical frames through the patched model state, under the test-only
    drift fault."""
    import torch
    from types import SimpleNamespace

    from support.vllm_state import join_tp_group

    join_tp_group()
    from vllm_omni.model_executor.models.fish_omni import model_state as ms

    state = object.__new__(ms.FishOmniModelState)
    state.buffers = SimpleNamespace(sampled_frames=torch.arange(22).reshape(2, 11))
    state._valid_rows, state._partitioned = [True, True], False
    try:
        state.postprocess_model_output(torch.zeros(2, 4), SimpleNamespace(num_reqs=2), None)
        return "passed"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def test_the_drift_fault_makes_the_last_rank_differ_on_identical_frames():
    """DRAMA3_PATCHES_FAULT=tp-drift (validate's negative control): the check names rank 1 at step 0."""
    runs = call_ranks(drift_fault_child, 2, env=_env(DRAMA3_PATCHES_TP_CHECK="1", DRAMA3_PATCHES_FAULT="tp-drift"),
                      pythonpath=PIL_QWEN2VL_PATH, timeout=900)
    for run in runs:
        assert run.startswith("TensorParallelDrift: step 0: ") and "rank(s) [1] differ" in run, run


def test_frames_check_is_off_by_default():
    r0, r1 = call_ranks(agreement_child, 2, env=_env(), pythonpath=PIL_QWEN2VL_PATH, timeout=900)
    assert r0["second_step"] == r1["second_step"] == "passed"  # rank 1's frame differs, unchecked
    assert r0["steps_checked"] == r1["steps_checked"] == 0


def _benchmark():
    spec = importlib.util.spec_from_file_location("tower_kv_groups", ROOT / "benchmarks" / "tower_kv_groups.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_split_tower_joins_the_backbone_kv_groups():
    rows = dict(call(_benchmark().table, timeout=600))
    tp1, published, split = rows["TP1"], rows["TP2 published"], rows["TP2 tower split"]
    assert tp1["groups"] == 2 and split["groups"] == tp1["groups"]  # backbone attention + GDN, tower inside
    assert published["groups"] > tp1["groups"]  # the whole-head tower needs groups of its own
    assert len(split["pages"]) == 1 and len(published["pages"]) == 1  # one pool page in each layout
    assert split["pages"][0] < published["pages"][0]  # the GDN state is no longer padded to the tower's page
    assert split["sequences"] > 1.5 * published["sequences"] and split["sequences"] > tp1["sequences"]


def ep_filter_child() -> dict:
    """vLLM's EP weight filter on fish_omni's config and checkpoint names, for EP 2."""
    from drama3_patches.tools.tiny_model import FISH_CFG, fish_tensor_specs
    from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids, should_skip_weight
    from vllm.transformers_utils.config import get_hf_text_config
    from vllm_omni.model_executor.models.fish_omni.configuration_fish_omni import FishOmniConfig

    # What ModelConfig.get_num_experts reads: the text config's num_experts.
    experts = get_hf_text_config(FishOmniConfig(text_config=FISH_CFG["text_config"])).num_experts
    specs = fish_tensor_specs(FISH_CFG)
    ranks = []
    for rank in (0, 1):
        local = compute_local_expert_ids(experts, 2, rank)
        ranks.append({"local": sorted(local), "skipped": sorted(n for n, *_ in specs if should_skip_weight(n, local))})
    return {"experts": experts, "ranks": ranks,
            "expert_weights": [n for n, _, _, role in specs if role == "expert_w"]}


def test_ep_weight_filter_reads_fish_omni_expert_names():
    """The 910b-tp2-ep profile sets enable_ep_weight_filter: it must find fish_omni's experts."""
    out = call(ep_filter_child, timeout=600)
    assert out["experts"] == 8  # the small checkpoint's routed experts
    for rank, got in enumerate(out["ranks"]):
        assert got["local"] == list(range(4 * rank, 4 * rank + 4))
        others = [f".experts.{e}." for e in range(8) if e not in got["local"]]
        # every other rank's expert weight is skipped before it is read; scales and all else are read
        expected = sorted(n for n in out["expert_weights"] if any(o in n for o in others))
        assert got["skipped"] == expected and len(expected) == 4 * 3 * 4  # 4 experts x 3 projections x 4 layers
