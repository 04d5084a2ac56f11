# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/ascend_config.py.
# Kept: AscendConfig (:399) with the one field the patches read, enable_fused_mc2 (0 unless
# additional_config sets it, :608); init_ascend_config(vllm_config) (:1793) builds it from
# vllm_config.additional_config; get_ascend_config() (:1945) raises RuntimeError until it is
# initialised; clear_ascend_config() forgets it. Left out: every other option and its checks.
_ASCEND_CONFIG = None


class AscendConfig:
    def __init__(self, vllm_config):
        extra = getattr(vllm_config, "additional_config", None) or {}
        self.enable_fused_mc2 = int(extra.get("enable_fused_mc2", 0))


def init_ascend_config(vllm_config) -> AscendConfig:
    global _ASCEND_CONFIG
    _ASCEND_CONFIG = AscendConfig(vllm_config)
    return _ASCEND_CONFIG


def clear_ascend_config() -> None:
    global _ASCEND_CONFIG
    _ASCEND_CONFIG = None


def get_ascend_config() -> AscendConfig:
    if _ASCEND_CONFIG is None:
        raise RuntimeError("Ascend config is not initialized. Please call init_ascend_config first.")
    return _ASCEND_CONFIG
