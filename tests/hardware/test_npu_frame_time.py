"""The per-frame time on the cards (``pytest -m npu``): ``validate`` profiles a window of stage 0's
decode steps through vLLM-Ascend's worker, whose profiler is torch-npu's (``torch_npu.profiler``,
a ``*_ascend_pt`` folder whose analysis writes ``ASCEND_PROFILER_OUTPUT/trace_view.json``). The
reader was built on the CPU rehearsal's trace (vLLM's torch profiler); this is where torch-npu's
layout meets it.

What must hold: the window ran, rank 0's trace was found and read, the steps were measured and
the top ops ranked, and the backbone, the tower and the sampler were found by their place in the
model (the structural rules, not class names: vLLM-Ascend replaces classes) with a record in every
step, so that no problem names them. ``DRAMA3_NPU_DEPLOY`` and
``DRAMA3_NPU_MODEL`` as in ``test_npu_validate.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from drama3_patches.tools.deploy_config import profiles

pytestmark = pytest.mark.npu

DEPLOY = os.environ.get("DRAMA3_NPU_DEPLOY") or str(profiles.profile_file("910b-tp2-ep"))
STEPS = 16


def test_the_cards_per_frame_time_finds_backbone_tower_and_sampler_by_their_place(tmp_path):
    out = tmp_path / "validate"
    model = os.environ.get("DRAMA3_NPU_MODEL")
    argv = [sys.executable, "-m", "drama3_patches.tools", "validate", "--deploy", DEPLOY, "--out", str(out),
            "--clones", "1", "--profile-steps", str(STEPS)]
    argv += ["--model", model] if model else ["--tiny-fp8"]
    env = dict(os.environ, DRAMA3_PATCHES="1", VLLM_LOGGING_LEVEL="INFO")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    print(done.stdout, done.stderr[-4000:])
    report = json.loads((out / "report.json").read_text())
    ft = report["frame_time"]
    assert ft and "error" not in ft, ft
    trace = Path(ft["trace"])
    assert trace.is_file() and (out / "profile") in trace.parents, ft["trace"]
    print("trace read:", trace, "steps from:", ft["steps_from"])
    assert ft["steps"] >= STEPS - 1, ft
    assert 0 < ft["step_ms"]["p50"] <= ft["step_ms"]["p90"], ft["step_ms"]
    assert ft["top_ops"] and all(o["ms_per_step"] > 0 for o in ft["top_ops"]), ft["top_ops"]
    md = (out / "report.md").read_text()
    assert "### Per-frame time (stage 0, concurrency 1)" in md
    # backbone, tower and sampler found by their place in the model on the card's trace, with a record
    # in every step (no problem names them)
    assert all((ft["rules"][k] or "").startswith("structure:") for k in ("backbone", "tower", "sampler")), ft["rules"]
    assert not [p for p in ft["problems"] if p.split(":")[0] in ("backbone", "tower", "sampler")], ft["problems"]
    assert all(ft["components_ms"][k] > 0 for k in ("backbone", "tower", "sampler")), ft["components_ms"]
    assert 0 <= ft["unattributed_ms"] < ft["step_ms"]["mean"], ft
    assert f"| unattributed | {ft['unattributed_ms']:.2f} |" in md
