# Stand-in for vllm-project/vllm-ascend public main (2026-08-22), vllm_ascend/device/device_config.py:
# get_ascend_device_type(). Upstream maps the SoC version torch_npu reports to an AscendDeviceType;
# here the answer is the module attribute SOC_DEVICE_TYPE, which tests set (default: a 910B, A2).
from vllm_ascend.device.hardware import AscendDeviceType

SOC_DEVICE_TYPE = AscendDeviceType.A2


def get_ascend_device_type() -> AscendDeviceType:
    return SOC_DEVICE_TYPE
