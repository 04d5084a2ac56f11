"""Which accelerator this process serves on, without importing torch or vllm."""

from __future__ import annotations

import importlib.util
import os
import sys

from drama3_patches import env


def _detect() -> str:
    # torch_npu is what vllm-ascend needs; its presence means an Ascend build.
    if importlib.util.find_spec("torch_npu") is not None:
        return "npu"
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return "cuda"
        except Exception:  # a broken CUDA runtime is not our concern here
            pass
        return "cpu"
    if os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version"):
        return "cuda"
    return "cpu"


def current_platform() -> str:
    return env.platform_override() or _detect()
