"""mamba-prefill-end on real vLLM (and the installed vllm-omni) with each vllm-ascend stand-in.

Each child is a fresh interpreter started the way an engine-core process starts: the
environment enables the patches, nothing is applied by hand (unless the start-up hook is not
installed in this environment, then it applies late). It then does what vLLM-Ascend does there,
``adapt_patch(is_global_patch=True)``, builds a real vLLM hybrid KV-cache manager (full
attention + Mamba), hands it to vllm-omni's scheduler set-up where the installed vllm-omni has one
(0.32.0rc1's OmniARScheduler installs a decode fast path on single-group managers only), and
allocates a prefill: the scheduler's allocation path, which passes ``prefill_end`` to every
manager.
"""

from __future__ import annotations

import shutil

import pytest

from support.replicas import ASCEND_030RC2, ASCEND_032, ASCEND_FIXED, ASCEND_MAIN, npu_env, profile, profile_paths
from support.subproc import ChildFailed, call

pytestmark = pytest.mark.vllm

TARGET = "vllm_ascend.patch.platform.patch_mamba_manager:AscendMambaManager.get_num_blocks_to_allocate"

# Every child here is a fresh interpreter started with the engine enabled: the start-up hook
# patches vLLM-Ascend's module as it imports, as in an engine-core process.


def _manager():
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    groups = [
        KVCacheGroupSpec(["attn.0"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)),
        KVCacheGroupSpec(["mamba.0"], MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,))),
    ]
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(config, max_model_len=256, scheduler_block_size=16, hash_block_size=16, enable_caching=False)


def _depth(func):
    n = 0
    while hasattr(func, "__wrapped__"):
        func, n = func.__wrapped__, n + 1
    return n


def _mine():
    import drama3_patches

    return {p["id"]: p for p in drama3_patches.status()["patches"]}["mamba-prefill-end"]


def allocation_child() -> dict:
    import importlib
    import inspect
    import sys

    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.request import Request

    import drama3_patches
    from drama3_patches._bootstrap import installed_finder
    import vllm_omni  # noqa: F401  (a vLLM-Omni stage's engine core has it loaded)

    out = {"hook": installed_finder() is not None}
    if not out["hook"]:
        drama3_patches.apply()

    import vllm_ascend.utils

    vllm_ascend.utils.adapt_patch(is_global_patch=True)  # vLLM-Ascend's global patches, engine-core side
    register_all_kvcache_specs(None)
    pm = sys.modules["vllm_ascend.patch.platform.patch_mamba_manager"]

    try:  # vllm-omni 0.32.0rc1: OmniARScheduler.__init__ offers its KV manager a decode fast path
        from vllm_omni.core.sched.fast_allocate import install_decode_allocate_fast_path
    except ImportError:  # 0.31.0rc1 has none
        install_decode_allocate_fast_path = None
    out["omni"] = sys.modules["vllm_omni"].__version__ if "vllm_omni" in sys.modules else None

    def step(rid):
        m = _manager()
        if install_decode_allocate_fast_path is not None:
            out["omni_fast_path"] = install_decode_allocate_fast_path(m)
        req = Request(rid, list(range(40)), SamplingParams(max_tokens=4), None)
        try:
            blocks = m.allocate_slots(req, 40)
        except TypeError as exc:
            return "TypeError: " + str(exc)
        return {"managers": [type(x).__name__ for x in m.coordinator.single_type_managers],
                "blocks": [len(b) for b in blocks.get_block_ids()]}

    cls = pm.AscendMambaManager
    meth = cls.__dict__["get_num_blocks_to_allocate"]
    st = _mine()
    out.update(state=st["state"], reason=st["reason"], targets=st["targets"])
    out["params"] = list(inspect.signature(meth).parameters)
    out["qualname"] = meth.__qualname__
    out["depth"] = _depth(meth)
    out["step"] = step("a")
    # Positional prefill_end (the ninth parameter in vLLM's signature) is accepted as well.
    m = _manager()
    m.coordinator.single_type_managers[1].req_to_blocks["p"]
    out["positional"] = cls.get_num_blocks_to_allocate(m.coordinator.single_type_managers[1], "p", 16, [], 0, 0, 16,
                                                       False, 40)
    if st["state"] == "applied":
        original = drama3_patches.get_original(TARGET)
        drama3_patches.unapply(["mamba-prefill-end"])
        out["restored_exactly"] = cls.__dict__["get_num_blocks_to_allocate"] is original
        out["step_unpatched"] = step("b")
        drama3_patches.apply(["mamba-prefill-end"])
        drama3_patches.apply(["mamba-prefill-end"])
        out["depth_after_apply_twice"] = _depth(cls.__dict__["get_num_blocks_to_allocate"])
        fresh = importlib.reload(pm).AscendMambaManager
        out["reload_new_class"] = fresh is not cls
        out["depth_after_reload"] = _depth(fresh.__dict__["get_num_blocks_to_allocate"])
        out["state_after_reload"] = _mine()["state"]
    return out


def _run(paths, extra_env=None):
    return call(allocation_child, env=npu_env(**(extra_env or {})), pythonpath=paths)


def import_targets_child() -> list:
    from drama3_patches.engine import get_engine

    get_engine().import_targets()
    st = _mine()
    return [st["state"], st["reason"]]


def import_manager_child() -> None:
    import drama3_patches

    drama3_patches.apply()
    import vllm_ascend.patch.platform.patch_mamba_manager  # noqa: F401


def status_child() -> list:
    st = _mine()
    return [st["state"], st["reason"]]


def global_patches_child() -> None:
    import drama3_patches
    from vllm_ascend.utils import adapt_patch

    drama3_patches.apply()
    adapt_patch(is_global_patch=True)


@pytest.fixture(scope="module", params=[ASCEND_MAIN, ASCEND_030RC2, ASCEND_032])
def applied(request):
    return request.param, _run(profile_paths(request.param))


def test_applied_with_its_target(applied):
    name, out = applied
    assert out["state"] == "applied", out["reason"]
    assert out["targets"] == [TARGET]


def test_scheduler_allocation_passes_through_the_ascend_manager(applied):
    _, out = applied
    assert out["step"] == {"managers": ["FullAttentionManager", "AscendMambaManager"], "blocks": [3, 3]}
    assert isinstance(out["positional"], int)
    assert out["omni"] in ("0.31.0rc1", "0.32.0rc1")
    if out["omni"] == "0.32.0rc1":
        # A hybrid manager keeps vLLM's allocate_slots (and so the Ascend manager) under vllm-omni.
        assert out["omni_fast_path"] is False


def test_without_the_patch_vllm_raises_type_error(applied):
    _, out = applied
    assert out["step_unpatched"].startswith("TypeError: ")
    assert "prefill_end" in out["step_unpatched"]


def test_wrapper_keeps_introspection_and_shows_the_new_parameter(applied):
    _, out = applied
    assert out["qualname"] == "AscendMambaManager.get_num_blocks_to_allocate"
    assert out["params"][-1] == "prefill_end"
    assert out["params"][:-1] == [
        "self", "request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
        "num_local_computed_tokens", "num_tokens_main_model", "apply_admission_cap",
    ]


def test_one_layer_after_apply_twice_and_reload_and_exact_restore(applied):
    _, out = applied
    assert out["depth"] == 1
    assert out["restored_exactly"] is True
    assert out["depth_after_apply_twice"] == 1
    assert out["reload_new_class"] is True
    assert out["depth_after_reload"] == 1
    assert out["state_after_reload"] == "applied"


def test_installed_by_the_import_trigger_before_the_manager_is_built(applied):
    _, out = applied
    if not out["hook"]:
        pytest.skip("the drama3_patches start-up hook (.pth) is not installed in this environment")
    # Applied by the trigger when vLLM-Ascend imported its module: nothing called apply().
    assert out["state"] == "applied" and out["depth"] == 1


def test_not_needed_when_the_ascend_manager_already_takes_prefill_end():
    out = _run(profile_paths(ASCEND_FIXED))
    assert out["state"] == "not-needed"
    assert "already accepts prefill_end" in out["reason"]
    assert out["depth"] == 0
    assert out["step"]["managers"] == ["FullAttentionManager", "AscendMambaManager"]


def test_missing_manager_module_inside_the_range_fails_naming_it(tmp_path):
    # vllm-ascend is installed at a version the manifest admits: a missing target is drift.
    root = tmp_path / "ascend_without_mamba_manager"
    shutil.copytree(profile(ASCEND_MAIN), root)
    (root / "vllm_ascend/patch/platform/patch_mamba_manager.py").unlink()
    state, reason = call(import_targets_child, env=npu_env(), pythonpath=[root])
    assert state == "failed"
    assert "ModuleNotFoundError" in reason and "patch_mamba_manager" in reason


def test_other_import_errors_of_the_ascend_module_propagate(tmp_path):
    root = tmp_path / "ascend_broken_mamba_manager"
    shutil.copytree(profile(ASCEND_MAIN), root)
    module = root / "vllm_ascend/patch/platform/patch_mamba_manager.py"
    module.write_text("raise ImportError('libascend_hal.so: cannot open shared object file')\n")
    with pytest.raises(ChildFailed) as failed:
        call(import_manager_child, env=npu_env(), pythonpath=[root])
    proc = failed.value.proc
    assert proc.returncode == 1
    assert "ImportError: libascend_hal.so: cannot open shared object file" in proc.stderr


def test_skipped_without_vllm_ascend():
    state, reason = call(status_child, env=npu_env())
    assert state == "skipped"
    assert "vllm-ascend" in reason


def test_another_override_without_prefill_end_is_named(tmp_path):
    # A later vLLM-Ascend could override a second method vLLM calls with prefill_end; the patch
    # cannot wrap what the manifest does not list, so it names the gap instead of staying silent.
    root = tmp_path / "ascend_second_override"
    shutil.copytree(profile(ASCEND_MAIN), root)
    module = root / "vllm_ascend/patch/platform/patch_mamba_manager.py"
    text = module.read_text()
    anchor = "\n\nsingle_type_kv_cache_manager.MambaManager = AscendMambaManager"
    module.write_text(text.replace(anchor, (
        "\n\n    def _needs_internal_checkpoint(self, request_id, query_start, query_end, checkpoint_position):\n"
        "        return False\n" + anchor
    )))
    out = call(global_patches_child, env=npu_env(VLLM_LOGGING_LEVEL="WARNING"), pythonpath=[root], with_output=True)
    assert "AscendMambaManager._needs_internal_checkpoint also lacks prefill_end" in out["output"]
