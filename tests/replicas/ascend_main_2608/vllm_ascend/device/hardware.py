# Stand-in for vllm-project/vllm-ascend public main (2026-08-22), vllm_ascend/device/hardware.py:
# the AscendDeviceType enum (A2 = 910B family, A3, _310P, A5 = Ascend 950, the one with MXFP8).
from enum import Enum


class AscendDeviceType(Enum):
    A2 = 0
    A3 = 1
    _310P = 2
    A5 = 3
