# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/device/hardware.py: the
# AscendDeviceType enum, numbered as that release numbers it (A2 = 910B family, A3 = 910C family,
# _310P, A5 = Ascend 950, the one family with MXFP8). Left out: the SoC-name tables and the helpers
# that map a SoC name to a family.
from enum import Enum


class AscendDeviceType(Enum):
    A2 = 0
    A3 = 1
    _310P = 2
    A5 = 3
