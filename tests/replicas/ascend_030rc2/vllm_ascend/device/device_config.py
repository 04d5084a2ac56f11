# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/device/device_config.py
# (same shape as public main of 2026-08-22): the frozen DeviceConfig, get_device_config() (cached),
# get_ascend_device_type(), is_310p() (:57), is_950() (:61). The release reads the family from
# vllm_ascend._build_info (fixed when the package is built); here BUILD_DEVICE_TYPE stands for it
# (default A2, a 910B), which tests change before clearing get_device_config's cache. Left out:
# check_ascend_device_type() (asks torch_npu for the runtime SoC).
from dataclasses import dataclass
from functools import lru_cache

from vllm_ascend.device.hardware import AscendDeviceType

BUILD_DEVICE_TYPE = AscendDeviceType.A2


@dataclass(frozen=True)
class DeviceConfig:
    _device_type: AscendDeviceType


def _device_type_from_build_info() -> AscendDeviceType:
    return BUILD_DEVICE_TYPE


@lru_cache(maxsize=1)
def get_device_config() -> DeviceConfig:
    return DeviceConfig(_device_type=_device_type_from_build_info())


def get_ascend_device_type() -> AscendDeviceType:
    return get_device_config()._device_type


def is_310p() -> bool:
    return get_ascend_device_type() == AscendDeviceType._310P


def is_950() -> bool:
    return get_ascend_device_type() == AscendDeviceType.A5
