"""``status`` and ``doctor`` say "target changed since review" where a patch that applies here
meets installed target source whose fingerprint the manifest's ``reviewed_source`` does not
record; unchanged targets say nothing. The installed vLLM's ``attach_router`` (metrics-endpoint)
is the target; a manifest copy whose record no longer matches it stands for a changed upstream.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from drama3_patches.manifest import parse_manifest
from drama3_patches.tools import doctor
from drama3_patches.tools.fingerprint import review_changes
from drama3_patches.tools.report import render_status
from support.subproc import ROOT

pytestmark = pytest.mark.vllm

TARGET = "vllm.entrypoints.serve.instrumentator.metrics:attach_router"
TEXT = (ROOT / "patches_manifest.yaml").read_text()


def _reviewed_elsewhere() -> str:
    """The manifest with metrics-endpoint's record replaced by one that no installed source gives."""
    line = next(x for x in TEXT.splitlines() if x.strip().startswith(f'"{TARGET}":'))
    changed = line[:line.index('": {') + 3] + f'{{"0.31.0": "{"0" * 16}", "0.32.0": "{"1" * 16}"}}'
    return TEXT.replace(line, changed)


def _status(state: str) -> dict:
    return {"enabled": True, "platform": "cpu", "pid": 1, "versions": {"vllm": "0.32.0"},
            "patches": [{"id": "metrics-endpoint", "state": state, "reason": "", "targets": [TARGET],
                         "requires": {"vllm": ">=0.31.0,<0.33"}}]}


def test_an_unchanged_target_says_nothing():
    assert review_changes(parse_manifest(TEXT), _status("applied")) == {}


def test_a_target_whose_source_differs_from_the_record_is_named():
    got = review_changes(parse_manifest(_reviewed_elsewhere()), _status("applied"))
    (change,) = got["metrics-endpoint"]
    assert change["target"] == TARGET
    assert change["reviewed"] == {"0.31.0": "0" * 16, "0.32.0": "1" * 16}
    assert change["fingerprint"] not in change["reviewed"].values()


def test_a_patch_that_does_not_apply_is_not_checked():
    assert review_changes(parse_manifest(_reviewed_elsewhere()), _status("skipped")) == {}


def test_status_table_and_doctor_list_the_changed_target():
    data = _status("applied")
    data["patches"][0]["changed_since_review"] = review_changes(parse_manifest(_reviewed_elsewhere()), data)[
        "metrics-endpoint"]
    assert "target changed since review (reviewed on 0.31.0, 0.32.0)" in render_status(data)
    lines = doctor.patch_lines(data)
    assert (f"  metrics-endpoint: {TARGET}: target changed since review (reviewed on 0.31.0, 0.32.0): review the "
            "patch on this version (drama3-patches drift shows what moved)") in lines
    # negative control: without the mark neither says it
    del data["patches"][0]["changed_since_review"]
    assert "changed since review" not in render_status(data)
    assert not any("changed since review" in line for line in doctor.patch_lines(data))


def _status_json(manifest_path) -> dict:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, DRAMA3_PATCHES="1", DRAMA3_PATCHES_PLATFORM="cpu",
               DRAMA3_PATCHES_MANIFEST=str(manifest_path), PYTHONPATH=path)
    r = subprocess.run([sys.executable, "-m", "drama3_patches.tools", "status", "--json"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.stdout, r.stderr
    return {p["id"]: p for p in json.loads(r.stdout)["patches"]}


def test_status_json_marks_the_changed_target_in_a_fresh_process(tmp_path):
    path = tmp_path / "manifest.yaml"
    path.write_text(_reviewed_elsewhere())
    path.chmod(0o600)
    row = _status_json(path)["metrics-endpoint"]
    assert row["state"] in ("pending", "applied")
    assert [c["target"] for c in row["changed_since_review"]] == [TARGET]
    path.write_text(TEXT)  # the shipped record: nothing to say
    assert "changed_since_review" not in _status_json(path)["metrics-endpoint"]
