"""The NPU tier's gate (tests/conftest.py, support.tiers), checked on any host: `pytest -m npu`
skips only where torch_npu is absent, and fails, naming the cause and the fix, where torch_npu is
installed but cannot be imported."""

from __future__ import annotations

import importlib.util

import pytest

from support import tiers
from support.subproc import run_pytest

HARDWARE = "tests/hardware/test_npu_hardware.py"


def _summary(proc) -> str:
    return proc.stdout + proc.stderr


def _last_line(proc) -> str:
    return proc.stdout.strip().splitlines()[-1]


def test_broken_torch_npu_fails_every_npu_test_naming_cause_and_fix(tmp_path):
    # A torch_npu that is installed (found first on the path) but whose import fails, as with
    # CANN not sourced.
    broken = tmp_path / "torch_npu"
    broken.mkdir()
    (broken / "__init__.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n")
    proc = run_pytest("-m", "npu", "-rfEs", HARDWARE, pythonpath=[tmp_path])
    out = _summary(proc)
    assert proc.returncode == 1, out
    assert "torch_npu is installed but cannot be imported: ImportError: libhccl.so" in out, out
    assert "source CANN's set_env.sh" in out and "uninstall torch_npu" in out, out
    last = _last_line(proc)
    assert "error" in last and "passed" not in last and "skipped" not in last, out
    assert "npu tests: FAIL" in out  # the header says it too


def test_a_torch_npu_without_a_device_fails(tmp_path):
    if importlib.util.find_spec("torch") is None:
        pytest.skip(tiers.TORCH_ABSENT)
    # torch_npu importable, device count 0 (a card not visible to this container).
    fake = tmp_path / "torch_npu"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import types, torch\n"
        "torch.npu = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)\n")
    proc = run_pytest("-m", "npu", "-rfEs", HARDWARE, pythonpath=[tmp_path])
    out = _summary(proc)
    assert proc.returncode == 1, out
    assert "torch_npu imports but sees no NPU" in out and "ASCEND_RT_VISIBLE_DEVICES" in out, out
    last = _last_line(proc)
    assert "error" in last and "passed" not in last and "skipped" not in last, out


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None,
                    reason="torch_npu is installed here: the absent case cannot be shown")
def test_without_torch_npu_every_npu_test_skips_with_the_reason():
    proc = run_pytest("-m", "npu", "-rfEs", HARDWARE)
    out = _summary(proc)
    assert proc.returncode == 0, out
    assert "SKIPPED [" in out and tiers.NPU_ABSENT in out, out
    last = _last_line(proc)
    assert "skipped" in last and "failed" not in last and "error" not in last, out
