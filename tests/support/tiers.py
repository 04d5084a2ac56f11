"""Why a tier cannot run here: the reasons tests/conftest.py prints, and the NPU probe.

The NPU tier skips only where ``torch_npu`` is absent. A ``torch_npu`` that is installed but
does not import, or imports and sees no device, fails every NPU test: a broken Ascend host must
not pass as one without a card.
"""

from __future__ import annotations

import importlib.util

NPU_RUN = "run `pytest -m npu` on an Ascend host"
NPU_ABSENT = f"no Ascend NPU here: torch_npu is not installed ({NPU_RUN})"
VLLM_ABSENT = "vllm is not installed in this environment (the nox sessions install 0.31.0 and 0.32.0)"
#: ``torch = pytest.importorskip("torch", reason=TORCH_ABSENT)`` at module level, before anything
#: that imports torch: without torch the module is skipped, at its own line, instead of failing
#: collection.
TORCH_ABSENT = ("torch is not installed in this environment: this module runs on CPU torch "
                "(the nox sessions install torch 2.13.0); without torch there is no torch_npu either")


def npu_device_count() -> int:
    """Run in a fresh interpreter by :func:`npu_problem`."""
    import torch
    import torch_npu  # noqa: F401

    return torch.npu.device_count() if torch.npu.is_available() else 0


def npu_problem() -> tuple[str, str] | None:
    """``None`` where the NPU tier can run, else ``("skip" | "fail", message)``.

    The probe imports torch_npu in a fresh interpreter: the test process itself must not start
    the device runtime, because the suite forks after this and a device runtime does not survive
    a fork.
    """
    if importlib.util.find_spec("torch_npu") is None:
        return "skip", NPU_ABSENT
    from support.subproc import ChildFailed, call

    try:
        count = call(npu_device_count, timeout=600)
    except ChildFailed as exc:
        return "fail", (
            f"torch_npu is installed but cannot be imported: {exc.last_error}. Fix the Ascend stack "
            "(source CANN's set_env.sh, install the torch_npu built for this torch and CANN) or, on a "
            "host without an NPU, uninstall torch_npu so the NPU tests skip."
        )
    if not count:
        return "fail", (
            "torch_npu imports but sees no NPU (torch.npu.device_count() is 0). Fix the device access "
            "(npu-smi info lists the cards; check ASCEND_RT_VISIBLE_DEVICES and the driver) or, on a "
            "host without an NPU, uninstall torch_npu so the NPU tests skip."
        )
    return None


def vllm_problem() -> str | None:
    return VLLM_ABSENT if importlib.util.find_spec("vllm") is None else None
