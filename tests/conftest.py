"""Test tiers (see docs/design.md): markers `vllm`, `npu`, `ray`, `packaging` skip with a printed reason."""

from __future__ import annotations

import importlib.util
import os

import pytest


def _npu_reason() -> str | None:
    if importlib.util.find_spec("torch_npu") is None:
        return "no Ascend NPU here: torch_npu is not installed (run `pytest -m npu` on an Ascend host)"
    try:
        import torch
        import torch_npu  # noqa: F401

        if not torch.npu.is_available() or torch.npu.device_count() == 0:
            return "torch_npu imports but sees no NPU (check ASCEND_RT_VISIBLE_DEVICES and the driver)"
    except Exception as exc:  # CANN missing, driver mismatch
        return f"torch_npu cannot be used here: {type(exc).__name__}: {exc}"
    return None


def _vllm_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed in this environment (the nox sessions install 0.31.0 and 0.32.0)"
    return None


def pytest_collection_modifyitems(config, items):
    reasons = {}
    for item in items:
        for marker, probe in (("npu", _npu_reason), ("vllm", _vllm_reason)):
            if marker in item.keywords:
                if marker not in reasons:
                    reasons[marker] = probe()
                if reasons[marker]:
                    item.add_marker(pytest.mark.skip(reason=reasons[marker]))


def pytest_report_header(config):
    from importlib import metadata

    def v(d):
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            return "-"

    lines = [f"drama3-patches tiers: vllm {v('vllm')}, torch {v('torch')}, vllm-omni {v('vllm-omni')}, "
             f"vllm-ascend {v('vllm-ascend')}"]
    npu = _npu_reason()
    if npu:
        lines.append(f"npu tests: skipped ({npu})")
    return lines


@pytest.fixture(autouse=True)
def _no_inherited_patch_env(monkeypatch):
    # The suite decides per test whether patches are on; never inherit the shell's.
    for name in list(os.environ):
        if name.startswith("DRAMA3_PATCHES"):
            monkeypatch.delenv(name, raising=False)
