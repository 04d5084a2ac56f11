"""``drama3-patches validate`` on the cards (``pytest -m npu``): the evidence a review of the port
asks for, on the 910B TP2+EP profile (``DRAMA3_NPU_DEPLOY`` picks another deploy file).

By default it serves a tiny published-format model with block-FP8 experts, made on the spot
(``drama3-patches tiny-model --fp8``: the 910B expansion path runs, no 37 GB download); with
``DRAMA3_NPU_MODEL`` set, the real checkpoint. The run's ``report.json`` is what is asserted, and
its ``report.md`` is left in the test's folder for the pull request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from drama3_patches.tools.deploy_config import profiles

pytestmark = pytest.mark.npu

DEPLOY = os.environ.get("DRAMA3_NPU_DEPLOY") or str(profiles.profile_file("910b-tp2-ep"))


def test_validate_passes_every_check_on_the_cards(tmp_path):
    out = tmp_path / "validate"
    model = os.environ.get("DRAMA3_NPU_MODEL")
    argv = [sys.executable, "-m", "drama3_patches.tools", "validate", "--deploy", DEPLOY, "--out", str(out)]
    argv += ["--model", model] if model else ["--tiny-fp8"]
    env = dict(os.environ, DRAMA3_PATCHES="1", VLLM_LOGGING_LEVEL="INFO")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    print(done.stdout, done.stderr[-4000:])
    report = json.loads((out / "report.json").read_text())
    failed = [c for c in report["checks"] if not c["passed"]]
    assert done.returncode == 0 and report["passed"] and not failed, failed
    counts = report["counts"]
    assert counts["preemptions"] > 0 and counts["resumes_verified"] > 0, counts
    if report["stage0"]["tensor_parallel_size"] > 1:
        assert counts["tp_steps_checked"] > 0, counts
    assert counts["voice_clones_completed"] == counts["requests_completed"] > 0, counts
