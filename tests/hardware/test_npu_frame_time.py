"""The per-frame time on the cards (``pytest -m npu``): ``validate`` profiles a window of stage 0's
decode steps through vLLM-Ascend's worker, whose profiler is torch-npu's (``torch_npu.profiler``,
a ``*_ascend_pt`` folder whose analysis writes ``ASCEND_PROFILER_OUTPUT/trace_view.json``). The
reader was built on the CPU rehearsal's trace (vLLM's torch profiler); this is where torch-npu's
layout meets it.

What must hold either way: the window ran, rank 0's trace was found and read, the steps were
measured and the top ops ranked. Where the trace holds the model's records, the components add
up to within 10% of the step; where it holds its modules only, the backbone and the tower are
read and the rest is reported as not attributed; where it holds neither, the report says plainly
that the time inside the step could not be attributed, rather than a guess. ``DRAMA3_NPU_DEPLOY`` and
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


def test_the_cards_per_frame_time_is_measured_and_attributed_or_says_why_not(tmp_path):
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
    if ft["attributed"]:
        comps = ft["components_ms"]
        assert all(comps[k] > 0 for k in ("backbone", "tower", "sampler")), comps
        assert abs(ft["component_sum_ms"] - ft["step_ms"]["mean"]) <= 0.10 * ft["step_ms"]["mean"], ft
        assert "| sum |" in md
    elif ft["components_ms"]:  # module records only (with_modules): backbone and tower, the rest said
        comps = ft["components_ms"]
        assert comps["backbone"] > 0 and comps["tower"] > 0, comps
        assert 0 <= ft["unattributed_ms"] < ft["step_ms"]["mean"], ft
        assert ft["note"].startswith("partly attributed") and "| not attributed |" in md
    else:
        assert ft["note"].startswith("cannot attribute"), ft
        assert "Components: cannot attribute time inside the step" in md
