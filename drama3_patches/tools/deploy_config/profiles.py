"""The NPU deploy configs shipped in ``drama3_patches/tools/deploy_config/configs/`` and a schema check.

The profiles are derived from vLLM-Omni 0.32.0rc1's published ``vllm_omni/deploy/fish_omni.yaml``
(:data:`DIFFERENCES_FROM_PUBLISHED` lists every key that differs, and why). The schema mirrors
vLLM-Omni 0.31.0rc1 / 0.32.0rc1 ``vllm_omni/config/stage_config.py`` (``DeployConfig``,
``StageDeployConfig``, ``load_deploy_config``, ``_apply_platform_overrides``). vLLM-Omni quietly
moves an unknown stage key into ``engine_extras`` and hands it to the engine arguments, so a typo
there would go unnoticed until the engine starts: this check names it instead.
"""

from __future__ import annotations

from typing import Any

PACKAGE = "drama3_patches.tools.deploy_config.configs"

# profile name -> file in drama3_patches/tools/deploy_config/configs/
PROFILES = {
    "910b-tp2-ep": "drama3_910b_tp2_ep.yaml",
    "910b-tp2-ep-graph": "drama3_910b_tp2_ep_graph.yaml",
    "mxfp8-1card": "drama3_mxfp8_1card.yaml",
}
DEFAULT_PROFILE = "910b-tp2-ep"

# DeployConfig fields common to vllm-omni 0.31.0rc1 and 0.32.0rc1, plus `base_config`
# (resolve_deploy_yaml).
TOP_LEVEL_KEYS = frozenset({
    "async_chunk", "session_mode", "model_runner", "active_stream_window", "duplex_session",
    "connectors", "edges", "stages", "platforms", "pipeline", "trust_remote_code",
    "distributed_executor_backend", "dtype", "quantization", "enable_prefix_caching",
    "enable_chunked_prefill", "data_parallel_size", "pipeline_parallel_size", "custom_voice_dir",
    "cuda_mps", "speech_cache", "base_config",
})

# StageDeployConfig fields (in both releases) this project's configs may use; the full class has
# many diffusion-only knobs, not accepted here on purpose.
STAGE_FIELDS = frozenset({
    "stage_id", "devices", "num_replicas", "env", "async_chunk", "output_connectors",
    "input_connectors", "default_sampling_params", "default_pooling_params",
    "subtalker_sampling_params", "silence_ban_frames", "tensor_parallel_size",
    "enable_expert_parallel", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
    "max_model_len", "enforce_eager", "async_scheduling", "disable_hybrid_kv_cache_manager",
    "mm_processor_cache_gb", "mamba_ssm_cache_dtype", "compilation_config", "profiler_config",
    "skip_mm_profiling", "config_format", "load_format", "tokenizer_mode", "engine_extras",
    "model_runner", "engine_args", "runtime",
})
# Stage keys that are not StageDeployConfig fields: vLLM-Omni passes them through engine_extras
# to the engine arguments (the published fish_omni.yaml sets the first two per stage).
STAGE_PASSTHROUGH_KEYS = frozenset({"trust_remote_code", "enable_prefix_caching", "block_size",
                                    "kv_cache_dtype", "seed", "enable_ep_weight_filter"})
# vllm-omni raises for these in engine_extras: the runner is chosen by model_runner.
FORBIDDEN_STAGE_KEYS = frozenset({"use_v2_model_runner", "supports_native_mrv2_data_plane"})
RUNNERS = ("v1", "v2")
PLATFORM_NAMES = frozenset({"npu", "cuda", "rocm", "xpu", "musa", "cpu"})
PLATFORM_KEYS = frozenset({"model_runner", "stages", "cuda_mps"})
# Connector extras that only do something on CUDA; fish_speech_dac_stateful refuses to start
# without fish_speech_dac_cuda_graphs (vllm-omni 0.32.0rc1 fish_speech_dac_decoder.py).
CUDA_ONLY_CONNECTOR_EXTRAS = ("fish_speech_dac_cuda_graphs", "fish_speech_dac_stateful")

# Every key in which the NPU profiles differ from vllm-omni 0.32.0rc1's deploy/fish_omni.yaml
# (flattened: stages by stage_id, `*` for any), and why.
DIFFERENCES_FROM_PUBLISHED = {
    "platforms.cuda": "MPS (cuda_mps) has no NPU counterpart",
    "platforms.npu": "Ascend paged attention takes 128-token cache blocks",
    "stages.0.enforce_eager": "eager instead of CUDA graphs (NPU graph mode unverified for Drama 3)",
    "stages.0.compilation_config": "CUDA graph mode and capture sizes: eager on NPU, or PIECEWISE up to the "
                                   "profile's streams (910b-tp2-ep-graph)",
    "connectors.*.extra.fish_speech_dac_cuda_graphs": "the DAC's channels-last CUDA graphs need CUDA",
    "connectors.*.extra.fish_speech_dac_stateful": "needs fish_speech_dac_cuda_graphs",
    "connectors.*.extra.fish_speech_dac_dtype": "fp16 was tuned for the CUDA decoder; float32 default",
    "stages.*.mamba_ssm_cache_dtype": "bfloat16 state measured on CUDA only; the checkpoint's float32",
    "stages.*.async_scheduling": "measured on CUDA only; synchronous, as the port measured",
    "stages.*.devices": "the cards of the profile",
    "stages.*.tensor_parallel_size": "the cards of the profile",
    "stages.0.enable_expert_parallel": "routed experts split over the stage's cards",
    "stages.0.enable_ep_weight_filter": "each rank reads only its own experts from disk",
    "stages.*.gpu_memory_utilization": "card memory and the stage sharing it",
    "stages.*.max_num_seqs": "the streams the port measured on these cards",
}


def profile_names() -> list[str]:
    return sorted(PROFILES)


def profile_file(name: str):
    """The shipped file of profile ``name`` (a ``pathlib.Path`` for an installed package)."""
    if name not in PROFILES:
        raise KeyError(f"unknown deploy profile {name!r}; known: {', '.join(profile_names())}")
    from importlib import resources  # not at import time: the CLI builds its parser from this module

    return resources.files(PACKAGE).joinpath(PROFILES[name])


def profile_text(name: str) -> str:
    return profile_file(name).read_text(encoding="utf-8")


def load_profile(name: str) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(profile_text(name))


def _device_list(devices: Any) -> list[int] | None:
    if not isinstance(devices, str):
        return None
    try:
        return [int(x) for x in devices.split(",") if x.strip() != ""]
    except ValueError:
        return None


def _check_stage(where: str, stage: Any, errors: list[str], *, overlay: bool) -> None:
    if not isinstance(stage, dict):
        errors.append(f"{where}: a stage must be a mapping")
        return
    if not isinstance(stage.get("stage_id"), int) or isinstance(stage.get("stage_id"), bool):
        errors.append(f"{where}: stage_id must be an integer")
    for key in stage:
        if key in FORBIDDEN_STAGE_KEYS:
            errors.append(f"{where}: {key!r} is set by vLLM-Omni from model_runner; remove it")
        elif key not in STAGE_FIELDS and key not in STAGE_PASSTHROUGH_KEYS:
            errors.append(f"{where}: unknown stage key {key!r}")
    if "model_runner" in stage and stage["model_runner"] not in RUNNERS:
        errors.append(f"{where}: model_runner must be one of {RUNNERS}, got {stage['model_runner']!r}")
    if "devices" in stage and _device_list(stage["devices"]) in (None, []):
        errors.append(f"{where}: devices must be a string of comma-separated card indices")
    util = stage.get("gpu_memory_utilization")
    if util is not None and not (isinstance(util, (int, float)) and 0 < util <= 1):
        errors.append(f"{where}: gpu_memory_utilization must be in (0, 1], got {util!r}")
    if overlay:
        return
    devices = _device_list(stage.get("devices"))
    tp = stage.get("tensor_parallel_size", 1)
    if devices and isinstance(tp, int) and len(devices) != tp:
        # vLLM-Omni refuses a stage whose world size its devices cannot hold.
        errors.append(f"{where}: tensor_parallel_size {tp} needs {tp} devices, got {stage.get('devices')!r}")
    if stage.get("enable_expert_parallel") and tp == 1:
        errors.append(f"{where}: enable_expert_parallel with tensor_parallel_size 1 has nothing to split")


def validate(doc: Any) -> list[str]:
    """Every problem found in a deploy config mapping, one line each ([] = valid)."""
    errors: list[str] = []
    if not isinstance(doc, dict):
        return ["the deploy config must be a mapping at the top level"]
    for key in doc:
        if key not in TOP_LEVEL_KEYS:
            errors.append(f"unknown top-level key {key!r}")
    if "stage_args" in doc:
        errors.append("the removed `stage_args` schema is used; use `stages`")
    if doc.get("model_runner", "v1") not in RUNNERS:
        errors.append(f"model_runner must be one of {RUNNERS}, got {doc.get('model_runner')!r}")
    stages = doc.get("stages")
    if not isinstance(stages, list) or not stages:
        errors.append("`stages` must be a non-empty list")
        return errors
    for i, stage in enumerate(stages):
        _check_stage(f"stages[{i}]", stage, errors, overlay=False)
    ids = [s.get("stage_id") for s in stages if isinstance(s, dict)]
    if len(ids) != len(set(ids)):
        errors.append(f"duplicate stage ids: {ids}")

    connectors = doc.get("connectors") or {}
    if not isinstance(connectors, dict):
        errors.append("`connectors` must be a mapping")
        connectors = {}
    for name, conn in connectors.items():
        if not isinstance(conn, dict) or not isinstance(conn.get("name"), str):
            errors.append(f"connectors.{name}: needs a `name` (the connector class)")
            continue
        for key in CUDA_ONLY_CONNECTOR_EXTRAS:
            if (conn.get("extra") or {}).get(key):
                errors.append(f"connectors.{name}.extra.{key} is CUDA-only; set it false for NPU")
    if doc.get("cuda_mps"):
        errors.append("cuda_mps (CUDA MPS) has no NPU counterpart; remove it")
    for stage in stages:
        if not isinstance(stage, dict):
            continue
        for field in ("input_connectors", "output_connectors"):
            for edge, conn in (stage.get(field) or {}).items():
                if conn not in connectors:
                    errors.append(f"stage {stage.get('stage_id')}: {field}.{edge} names unknown connector {conn!r}")

    platforms = doc.get("platforms") or {}
    if not isinstance(platforms, dict):
        errors.append("`platforms` must be a mapping")
        platforms = {}
    for plat, section in platforms.items():
        if plat not in PLATFORM_NAMES:
            errors.append(f"platforms: unknown platform {plat!r}")
        if not isinstance(section, dict):
            errors.append(f"platforms.{plat}: must be a mapping")
            continue
        for key in section:
            if key not in PLATFORM_KEYS:
                errors.append(f"platforms.{plat}: unknown key {key!r}")
        if "model_runner" in section and section["model_runner"] not in RUNNERS:
            errors.append(f"platforms.{plat}.model_runner must be one of {RUNNERS}")
        if plat == "npu" and section.get("cuda_mps"):
            errors.append("platforms.npu.cuda_mps: CUDA MPS has no NPU counterpart; remove it")
        for j, ps in enumerate(section.get("stages") or []):
            _check_stage(f"platforms.{plat}.stages[{j}]", ps, errors, overlay=True)
            if isinstance(ps, dict) and ps.get("stage_id") not in ids:
                errors.append(f"platforms.{plat}.stages[{j}]: no stage {ps.get('stage_id')!r} to override")

    for plat in [None, *sorted(platforms)]:
        errors.extend(_check_memory_sums(effective_stages(doc, plat), plat))
    return errors


def effective_stages(doc: dict, platform: str | None) -> list[dict]:
    """Stages after a platform section's overrides (flat layout), as vLLM-Omni merges them."""
    stages = [dict(s) for s in doc.get("stages") or [] if isinstance(s, dict)]
    section = (doc.get("platforms") or {}).get(platform) if platform else None
    by_id = {s.get("stage_id"): s for s in stages}
    for ps in (section or {}).get("stages") or []:
        if isinstance(ps, dict) and ps.get("stage_id") in by_id:
            by_id[ps["stage_id"]].update({k: v for k, v in ps.items() if k != "stage_id"})
    return stages


def effective_runner(doc: dict, platform: str | None, stage: dict) -> str:
    """The runner a stage runs, as vLLM-Omni resolves it: its own `model_runner`, else the
    deploy-level one (a platform section's replacing the top level's); a platform section's
    `model_runner: v1` also clears a stage's own v2 (the platform's V1 fallback)."""
    section = ((doc.get("platforms") or {}).get(platform) or {}) if platform else {}
    deploy_level = section.get("model_runner", doc.get("model_runner", "v1"))
    own = stage.get("model_runner")
    if own == "v2" and section.get("model_runner") == "v1":
        own = None
    return own or deploy_level


def _check_memory_sums(stages: list[dict], platform: str | None) -> list[str]:
    per_card: dict[int, float] = {}
    for s in stages:
        for d in _device_list(s.get("devices")) or []:
            per_card[d] = per_card.get(d, 0.0) + float(s.get("gpu_memory_utilization") or 0.9)
    where = f"platform {platform}" if platform else "base config"
    return [
        f"{where}: card {d} is given gpu_memory_utilization {total:.2f} in total (over 1.0)"
        for d, total in sorted(per_card.items())
        if total > 1.0 + 1e-9
    ]
