# Stand-in for vllm-project/vllm-ascend public main, commit 182b75ea84 (2026-08-22),
# vllm_ascend/device/device_config.py. Kept, with upstream's names: the frozen DeviceConfig,
# get_device_config() (cached), get_ascend_device_type(), is_310p(), is_950(). Upstream's
# _device_type_from_build_info() reads vllm_ascend._build_info.__device_type__ (fixed when the
# package is built for one SoC family); here it returns BUILD_DEVICE_TYPE, which tests set
# (default: a 910B, A2) before clearing get_device_config's cache. Left out:
# check_ascend_device_type() (it asks torch_npu for the runtime SoC).
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
