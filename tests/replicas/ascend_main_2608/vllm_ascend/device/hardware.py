# Stand-in for vllm-project/vllm-ascend public main, commit 182b75ea84 (2026-08-22),
# vllm_ascend/device/hardware.py: the AscendDeviceType enum as upstream numbers it (A2 = 910B
# family, A3 = 910C family, _310P, A5 = Ascend 950, the family with MXFP8). Left out: the
# SoC-version tables and the helpers that map a SoC name to a family.
from enum import Enum


class AscendDeviceType(Enum):
    A2 = 0
    A3 = 1
    _310P = 2
    A5 = 3
