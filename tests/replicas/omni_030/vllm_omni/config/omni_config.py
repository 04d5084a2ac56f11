# Stand-in for vllm-project/vllm-omni 0.30.0 (PyPI wheel), vllm_omni/config/omni_config.py (the
# structured-config path). Kept: its import of the deploy loader by name (a patch of stage_config
# must reach this name too), _stage_engine_overrides (a stage's engine_extras become its engine
# overrides) and, from _build_model_config, how a stage's model config gets use_v2_model_runner:
# the stage's own override if it has one, else `deploy.model_runner == "v2"`. Upstream rejects
# stage overrides no config owns (e.g. a bare `model_runner` key); use_v2_model_runner is owned.
from __future__ import annotations

from typing import Any

from vllm_omni.config.stage_config import DeployConfig, StageDeployConfig, _apply_platform_overrides

_MODEL_ENGINE_FIELDS = frozenset({"use_v2_model_runner", "trust_remote_code", "dtype", "max_model_len"})


def resolve_deploy(deploy: DeployConfig, platform: str | None = None) -> DeployConfig:
    # Upstream does this in VllmOmniConfig's builder.
    return _apply_platform_overrides(deploy, platform)


def _stage_engine_overrides(stage_deploy: StageDeployConfig | None) -> dict[str, Any]:
    if stage_deploy is None:
        return {}
    return dict(stage_deploy.engine_extras)


def _build_model_config(pipeline, deploy, topology, stage_deploy, engine, *, duplex_max_sessions=0, model=None):
    unowned = set(engine) - _MODEL_ENGINE_FIELDS - {"tensor_parallel_size", "enable_expert_parallel", "block_size"}
    if unowned:
        raise ValueError(f"Stage {getattr(stage_deploy, 'stage_id', '?')} has explicit engine argument(s) "
                         f"with no structured config owner: {', '.join(sorted(unowned))}")
    kwargs = {k: v for k, v in engine.items() if k in _MODEL_ENGINE_FIELDS}
    kwargs.setdefault("use_v2_model_runner", deploy.model_runner == "v2")
    return kwargs
