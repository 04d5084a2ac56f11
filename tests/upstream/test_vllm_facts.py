"""The vLLM-side facts runner-selection, lora-count-forwarding and mamba-prefill-end rely on.

Read from the installed vLLM (0.31 or 0.32): signatures from the real classes, call sites from
the real source of the methods that make the calls, behaviour from the real property. If a vLLM
release changes one of these, the test names the fact that no longer holds.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def _calls(func, attr: str) -> list[ast.Call]:
    """Calls ``<something>.attr(...)`` in the source of ``func``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    return [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
    ]


# -- mamba-prefill-end ------------------------------------------------------------------------


def test_mamba_manager_takes_prefill_end_with_default_zero():
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager, SingleTypeKVCacheManager

    for cls in (MambaManager, SingleTypeKVCacheManager):
        params = inspect.signature(cls.get_num_blocks_to_allocate).parameters
        assert list(params)[:7] == [
            "self", "request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
            "num_local_computed_tokens", "num_tokens_main_model",
        ], cls
        assert params["prefill_end"].default == 0, cls
        assert params["prefill_end"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_coordinator_passes_prefill_end_to_every_non_cross_attention_manager():
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    calls = _calls(KVCacheCoordinator.get_num_blocks_to_allocate, "get_num_blocks_to_allocate")
    passing = [c for c in calls if any(k.arg == "prefill_end" for k in c.keywords)]
    assert passing, "KVCacheCoordinator no longer passes prefill_end to the managers"
    assert all(isinstance(c.func.value, ast.Name) and c.func.value.id == "manager" for c in passing)


def test_kv_cache_manager_computes_prefill_end_and_passes_it_on():
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    source = inspect.getsource(KVCacheManager.allocate_slots)
    assert "max(request.num_prompt_tokens, request.num_tokens - 1)" in source
    calls = _calls(KVCacheManager.allocate_slots, "get_num_blocks_to_allocate")
    assert calls and all(any(k.arg == "prefill_end" for k in c.keywords) for c in calls)


def test_register_all_kvcache_specs_reads_the_module_global_mamba_manager():
    # Why vLLM-Ascend's rebinding of single_type_kv_cache_manager.MambaManager takes effect.
    from vllm.v1.core import single_type_kv_cache_manager as stkcm

    names = {n.id for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(stkcm.register_all_kvcache_specs))))
             if isinstance(n, ast.Name)}
    assert "MambaManager" in names


# -- lora-count-forwarding --------------------------------------------------------------------


def test_mrv2_prepare_inputs_requires_num_active_loras():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    params = inspect.signature(GPUModelRunner.prepare_inputs).parameters
    assert list(params) == ["self", "scheduler_output", "batch_req_state", "batch_desc", "num_active_loras"]
    assert params["num_active_loras"].default is inspect.Parameter.empty


def test_mrv2_execute_model_calls_prepare_inputs_with_four_positional_arguments():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    calls = [
        c for c in _calls(GPUModelRunner.execute_model, "prepare_inputs")
        if isinstance(c.func.value, ast.Name) and c.func.value.id == "self"  # not model_state's
    ]
    assert len(calls) == 1
    (call,) = calls
    assert [a.id for a in call.args] == ["scheduler_output", "batch_req_state", "batch_desc", "num_active_loras"]
    assert not call.keywords


def test_batch_descriptor_carries_num_active_loras():
    # lora-count-forwarding falls back to it when a caller leaves the count out.
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    assert "num_active_loras" in inspect.signature(BatchExecutionDescriptor).parameters
    assert inspect.signature(BatchExecutionDescriptor).parameters["num_active_loras"].default == 0


# -- runner-selection -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_config():
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"))


def test_use_v2_model_runner_is_a_property_of_vllm_config():
    from vllm.config.vllm import VllmConfig

    assert isinstance(inspect.getattr_static(VllmConfig, "use_v2_model_runner"), property)


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False)])
def test_use_v2_model_runner_variable_wins(monkeypatch, cpu_config, value, expected):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    assert cpu_config.use_v2_model_runner is expected


@pytest.mark.parametrize("has_triton", [True, False])
def test_use_v2_model_runner_unset_follows_triton(monkeypatch, cpu_config, has_triton):
    import vllm.config.vllm as config_module

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(config_module, "HAS_TRITON", has_triton)
    assert cpu_config._get_v2_model_runner_unsupported_features() == []
    assert cpu_config.use_v2_model_runner is has_triton


def test_gpu_worker_takes_the_process_wide_choice():
    # vLLM's own worker copies the config property; so does vLLM-Ascend's NPUWorker.
    from vllm.v1.worker.gpu_worker import Worker

    assert "self.use_v2_model_runner = vllm_config.use_v2_model_runner" in inspect.getsource(Worker.__init__)


def test_engine_core_loads_general_plugins_before_registering_kv_managers():
    # vLLM-Ascend applies its global patches (AscendMambaManager included) from its general
    # plugins; mamba-prefill-end is installed when that module is imported. Both must happen
    # before the engine core registers the managers it will build.
    from vllm.v1.engine.core import EngineCore

    def first_lines(func) -> dict:
        lines = {}
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(func)))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                lines.setdefault(name, node.lineno)
        return lines

    init = first_lines(EngineCore.__init__)
    assert init["load_general_plugins"] < init["_initialize_kv_caches"]
    assert "register_all_kvcache_specs" in first_lines(EngineCore._initialize_kv_caches)


# -- qwen3next-eager-attention ------------------------------------------------------------------


def test_platform_is_cuda_and_is_xpu_are_by_platform_enum():
    # vLLM-Ascend's NPUPlatform is PlatformEnum.OOT: vLLM's fused-kernel check is false there.
    from vllm.platforms.interface import Platform, PlatformEnum

    class OutOfTree(Platform):
        _enum = PlatformEnum.OOT

    assert OutOfTree().is_cuda() is False and OutOfTree().is_xpu() is False
    assert "_enum" in inspect.getsource(Platform.is_cuda)


def test_only_project_qkv_gate_reads_the_fused_flag_and_only_forward_calls_it():
    from vllm.model_executor.models.qwen3_next import Qwen3NextAttention

    readers = {
        name for name, member in vars(Qwen3NextAttention).items() if callable(member)
        and any(isinstance(n, ast.Attribute) and n.attr == "use_fused_qk_norm_rope_gate"
                and isinstance(n.ctx, ast.Load) for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(member)))))
    }
    assert readers == {"_project_qkv_gate"}
    callers = {name for name, member in vars(Qwen3NextAttention).items()
               if callable(member) and _calls(member, "_project_qkv_gate")}
    assert callers == {"forward"}


def test_qwen3_5_layers_build_qwen3_next_attention_on_the_hf_text_config():
    # Drama 3's backbone: its attention layers get hf_text_config (FishOmniConfig.text_config).
    # Read, not imported: the module pulls torchvision (vision tower), which CPU test hosts lack.
    import importlib.util

    text = Path(importlib.util.find_spec("vllm.model_executor.models.qwen3_5").origin).read_text()
    layer = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "Qwen3_5DecoderLayer")
    source = ast.get_source_segment(text, _function(layer, "__init__"))
    assert "config = vllm_config.model_config.hf_text_config" in source
    assert "Qwen3NextAttention(" in source
    assert 'config.model_type == "qwen3_5_moe_text"' in source


# -- the published vllm-omni, read without importing it (its import patches vLLM) -----------------


def _omni_source(rel: str) -> ast.Module:
    from importlib import metadata

    try:
        dist = metadata.distribution("vllm-omni")
    except metadata.PackageNotFoundError:
        pytest.skip("vllm-omni is not installed")
    return ast.parse(Path(dist.locate_file(rel)).read_text())


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_omni_loader_refuses_v2_on_npu_asked_by_the_deploy_or_any_stage():
    fn = ast.unparse(_function(_omni_source("vllm_omni/config/stage_config.py"), "_apply_platform_overrides"))
    assert "deploy.model_runner == 'v2' or any((stage.model_runner == 'v2' for stage in deploy.stages))" in fn
    assert "platform in {'npu', 'xpu'}" in fn and "raise NotImplementedError" in fn


def test_omni_engine_args_take_each_stages_own_runner():
    tree = _omni_source("vllm_omni/config/stage_config.py")
    fn = ast.unparse(_function(tree, "_build_engine_args"))
    assert "stage_runner = resolve_stage_model_runner(deploy, ds)" in fn
    assert "engine_args['use_v2_model_runner'] = stage_runner == 'v2'" in fn
    resolve = ast.unparse(_function(tree, "resolve_stage_model_runner"))
    assert "return runner or deploy.model_runner" in resolve


def test_omni_execute_model_passes_four_arguments_to_prepare_inputs():
    fn = _function(_omni_source("vllm_omni/worker_v2/omni_model_runner.py"), "execute_model")
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "prepare_inputs" and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
    assert [[a.id for a in c.args] for c in calls] == [
        ["scheduler_output", "batch_req_state", "batch_desc", "num_active_loras"]]
