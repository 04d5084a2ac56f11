# Stand-in for vllm-project/vllm-omni 0.30.0 (PyPI wheel), vllm_omni/config/omni_config.py: only
# its import of the deploy loader by name (`from ...stage_config import _apply_platform_overrides`),
# which a patch of stage_config must also reach, and the call site that uses that name.
from vllm_omni.config.stage_config import DeployConfig, _apply_platform_overrides


def resolve_deploy(deploy: DeployConfig, platform: str | None = None) -> DeployConfig:
    # Upstream does this inside its stage-config builder.
    return _apply_platform_overrides(deploy, platform)
