# Stand-in for vllm-project/vllm-omni 0.30.0 (PyPI wheel), vllm_omni/config/stage_config.py.
# Kept: DeployConfig / StageDeployConfig with the fields the runner choice touches, and the
# behaviour of _apply_platform_overrides (a `platforms.<name>.model_runner` override, validated;
# NotImplementedError for v2 on npu and xpu; per-stage platform overrides of devices, env and
# plain fields) and of the runner part of _build_engine_args (every stage's engine args carry
# `use_v2_model_runner = deploy.model_runner == "v2"`; engine_extras may not set it).
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class StageDeployConfig:
    stage_id: int
    devices: str | None = None
    env: dict[str, Any] | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool | None = None
    engine_extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class DeployConfig:
    async_chunk: bool = True
    model_runner: Literal["v1", "v2"] = "v1"
    stages: list[StageDeployConfig] = field(default_factory=list)
    platforms: dict[str, Any] | None = None


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
            if key not in ("stage_id", "devices", "env") and hasattr(base, key):
                setattr(base, key, val)
    return deploy


def _build_engine_args(ds: StageDeployConfig | None, deploy: DeployConfig) -> dict[str, Any]:
    # Upstream takes (ps, ds, pipeline, deploy, next_stage_proc); only the runner part is kept.
    engine_args: dict[str, Any] = {}
    if ds is not None:
        for reserved in ("use_v2_model_runner", "supports_native_mrv2_data_plane"):
            if reserved in ds.engine_extras:
                raise ValueError(
                    f"stage {ds.stage_id}: {reserved!r} must not be set via engine_extras; "
                    "it is derived from the deploy-level `model_runner` field."
                )
    engine_args["use_v2_model_runner"] = deploy.model_runner == "v2"
    return engine_args
