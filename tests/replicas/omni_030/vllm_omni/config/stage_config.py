# Stand-in for vllm-project/vllm-omni 0.30.0 (PyPI wheel), vllm_omni/config/stage_config.py.
# Kept: DeployConfig / StageDeployConfig (a subset of their fields), load_deploy_config and
# _parse_stage_deploy (a stage key that is not a StageDeployConfig field lands in
# engine_extras; no base_config inheritance here), the behaviour of _apply_platform_overrides
# (a validated `platforms.<name>.model_runner`; NotImplementedError for v2 on npu and xpu;
# per-stage platform overrides of devices, env and fields, other keys into engine_extras), and
# the runner part of _build_engine_args with its real signature: every stage's engine args carry
# `use_v2_model_runner = deploy.model_runner == "v2"`, and engine_extras may not set it.
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml


@dataclass
class StageDeployConfig:
    stage_id: int
    devices: str | None = None
    num_replicas: int = 1
    env: dict[str, Any] | None = None
    async_chunk: bool | None = None
    output_connectors: dict[str, str] | None = None
    input_connectors: dict[str, str] | None = None
    default_sampling_params: dict[str, Any] | None = None
    tensor_parallel_size: int | None = None
    enable_expert_parallel: bool | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enforce_eager: bool | None = None
    async_scheduling: bool | None = None
    engine_extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class DeployConfig:
    async_chunk: bool = True
    session_mode: str = "turn"
    model_runner: Literal["v1", "v2"] = "v1"
    connectors: dict[str, Any] | None = None
    edges: list[dict[str, Any]] | None = None
    stages: list[StageDeployConfig] = field(default_factory=list)
    platforms: dict[str, Any] | None = None
    pipeline: str | None = None
    trust_remote_code: bool | None = None
    dtype: str | None = None
    quantization: str | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None


_STAGE_RESERVED_KEYS = frozenset(
    {"async_chunk", "stage_id", "devices", "num_replicas", "env", "output_connectors", "input_connectors",
     "default_sampling_params", "default_pooling_params", "engine_extras", "engine_args", "runtime"}
)
_STAGE_DEPLOY_FIELDS = {f.name for f in fields(StageDeployConfig) if f.name not in _STAGE_RESERVED_KEYS}
_PIPELINE_WIDE_ENGINE_FIELDS = ("trust_remote_code", "dtype", "quantization", "enable_prefix_caching",
                                "enable_chunked_prefill")


def _parse_stage_deploy(stage_data: dict[str, Any]) -> StageDeployConfig:
    flat_args = {k: v for k, v in stage_data.items() if k not in _STAGE_RESERVED_KEYS}
    flat_args.update(stage_data.get("engine_args") or {})
    kwargs: dict[str, Any] = {"stage_id": stage_data["stage_id"], "devices": stage_data.get("devices"),
                              "env": stage_data.get("env")}
    for name in _STAGE_DEPLOY_FIELDS:
        if name in flat_args:
            kwargs[name] = flat_args.pop(name)
    for name in ("async_chunk", "output_connectors", "input_connectors", "default_sampling_params"):
        kwargs[name] = stage_data.get(name)
    kwargs["engine_extras"] = {**dict(stage_data.get("engine_extras") or {}), **flat_args}
    return StageDeployConfig(**kwargs)


def load_deploy_config(path: str | Path) -> DeployConfig:
    raw_dict = yaml.safe_load(Path(path).read_text()) or {}
    stages = [_parse_stage_deploy(s) for s in raw_dict.get("stages", [])]
    model_runner = raw_dict.get("model_runner", "v1")
    if model_runner not in ("v1", "v2"):
        raise ValueError(f"model_runner must be one of ('v1', 'v2'), got {model_runner!r}")
    kwargs: dict[str, Any] = {
        "async_chunk": raw_dict.get("async_chunk", True),
        "session_mode": raw_dict.get("session_mode", "turn"),
        "model_runner": model_runner,
        "connectors": raw_dict.get("connectors", None),
        "edges": raw_dict.get("edges", None),
        "stages": stages,
        "platforms": raw_dict.get("platforms", None),
        "pipeline": raw_dict.get("pipeline", None),
    }
    for name in _PIPELINE_WIDE_ENGINE_FIELDS:
        if name in raw_dict:
            kwargs[name] = raw_dict[name]
    return DeployConfig(**kwargs)


def _apply_platform_overrides(
    deploy: DeployConfig,
    platform: str | None = None,
) -> DeployConfig:
    """Merge platform-specific runner and stage overrides into deploy config."""
    if platform is None:
        from vllm_omni.platforms import current_omni_platform

        device_name = current_omni_platform.device_name
        platform = device_name.lower() if device_name is not None else None
    platform_section = (deploy.platforms or {}).get(platform) if platform is not None else None
    if platform_section is not None and "model_runner" in platform_section:
        model_runner = platform_section["model_runner"]
        if model_runner not in ("v1", "v2"):
            raise ValueError(f"platform model_runner must be one of ('v1', 'v2'), got {model_runner!r}")
        deploy.model_runner = model_runner
    if deploy.model_runner == "v2" and platform in {"npu", "xpu"}:
        raise NotImplementedError(
            f"Model Runner V2 is not supported on {platform.upper()}: "
            "the platform worker still uses the legacy chunk-transfer data plane."
        )
    if platform is None or deploy.platforms is None:
        return deploy
    if platform_section is None:
        return deploy
    base_by_id = {s.stage_id: s for s in deploy.stages}
    for ps in platform_section.get("stages", []):
        base = base_by_id.get(ps["stage_id"])
        if base is None:
            continue
        if ps.get("devices") is not None:
            base.devices = ps["devices"]
        if ps.get("env") is not None:
            base.env = {**(base.env or {}), **ps["env"]}
        for key, val in ps.items():
            if key in ("stage_id", "devices", "env"):
                continue
            if hasattr(base, key):
                setattr(base, key, val)
            else:
                base.engine_extras[key] = val
    return deploy


def _build_engine_args(ps, ds: StageDeployConfig | None, pipeline, deploy: DeployConfig, next_stage_proc) -> dict[str, Any]:
    # Topology-derived entries (from ps / pipeline / next_stage_proc) are left out.
    engine_args: dict[str, Any] = {}
    for name in _PIPELINE_WIDE_ENGINE_FIELDS:
        value = getattr(deploy, name)
        if value is not None:
            engine_args[name] = value
    if ds is not None:
        for k, v in asdict(ds).items():
            if k in _STAGE_RESERVED_KEYS or v is None:
                continue
            engine_args[k] = v
        engine_args.update(ds.engine_extras)
    if ds is not None:
        for reserved in ("use_v2_model_runner", "supports_native_mrv2_data_plane"):
            if reserved in ds.engine_extras:
                raise ValueError(
                    f"stage {ds.stage_id}: {reserved!r} must not be set via engine_extras; "
                    "it is derived from the deploy-level `model_runner` field and the "
                    "pipeline's `supports_native_mrv2_data_plane` declaration."
                )
    engine_args["use_v2_model_runner"] = deploy.model_runner == "v2"
    return engine_args
