"""When every patch steps aside because vLLM / vLLM-Omni moved past the reviewed range, the first
target import says so once per process (drama3_patches.reviewed, Engine._tell_out_of_range)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from drama3_patches import reviewed
from support.selftest import write_dist, write_manifest, write_target
from support.subproc import run_python

OMNI_SPEC, VLLM_SPEC = '"vllm-omni": ">=0.31.0rc1,<0.33"', '"vllm": ">=0.31.0,<0.33"'


@pytest.mark.parametrize("specs,expected", [
    ([">=0.31.0,<0.33", ">=0.32.0,<0.33"], "0.31-0.32"),
    ([">=0.31.0rc1,<0.33"], "0.31-0.32"),
    ([">=0.32.0,<0.33"], "0.32"),
    ([">=0.32.0"], ">=0.32.0"),               # no upper bound: said as written
    ([">=0.31,<1.0"], ">=0.31,<1.0"),         # <1.0 has no minor before it
])
def test_span_reads_the_manifest_ranges_as_minors(specs, expected):
    assert reviewed.span(specs) == expected


def _manifest(*requires):
    return SimpleNamespace(patches=[SimpleNamespace(id=f"p{i}", requires=r) for i, r in enumerate(requires)])


def test_verdict_names_the_reviewed_range_and_how_many_patches_step_aside():
    m = _manifest({"vllm": ">=0.31.0,<0.33", "vllm-omni": ">=0.31.0rc1,<0.33"}, {"vllm-omni": ">=0.32.0rc1,<0.33"},
                  {"vllm": ">=0.32.0,<0.33"})
    new = {"vllm": "0.34.0", "vllm-omni": "0.34.0rc1"}.get
    assert reviewed.verdict(m, new) == ("this patch set was reviewed for vLLM 0.31-0.32; 0.34.0 is installed; "
                                        "vLLM-Omni 0.31-0.32; 0.34.0rc1 is installed: every patch is skipped")
    only_vllm = {"vllm": "0.34.0", "vllm-omni": "0.32.0rc1"}.get
    assert reviewed.verdict(m, only_vllm) == ("this patch set was reviewed for vLLM 0.31-0.32; 0.34.0 is installed: "
                                              "2 of 3 patches are skipped")
    assert reviewed.verdict(m, {"vllm": "0.32.0", "vllm-omni": "0.32.0rc1"}.get) is None
    assert reviewed.verdict(m, {"vllm": None, "vllm-omni": None}.get) is None  # not installed: doctor's line


CHILD = """
import d3p_target, d3p_second, importlib
importlib.reload(d3p_target)
print(d3p_target.greet("x"))
"""


def _run(tmp_path, vllm_version):
    write_target(tmp_path)
    write_target(tmp_path, "d3p_second", "def other():\n    return 'other'\n")
    write_dist(tmp_path, "vllm", vllm_version)
    write_dist(tmp_path, "vllm-omni", "0.32.0rc1")
    manifest = write_manifest(
        tmp_path,
        {"id": "one", "targets": ["d3p_target:greet"], "requires": "{" + VLLM_SPEC + "}"},
        {"id": "two", "targets": ["d3p_second:other"], "requires": "{" + VLLM_SPEC + ", " + OMNI_SPEC + "}"})
    env = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "cpu", "DRAMA3_PATCHES_MANIFEST": str(manifest)}
    return run_python(CHILD, env=env, pythonpath=[tmp_path])


def test_outside_every_range_the_first_target_import_warns_once(tmp_path):
    proc = _run(tmp_path, "0.34.0")
    assert proc.stdout.strip() == "hello x!"  # every patch stepped aside: the original runs
    lines = [ln for ln in proc.stderr.splitlines() if "reviewed for" in ln]
    assert lines == ["drama3-patches: warning: this patch set was reviewed for vLLM 0.31-0.32; 0.34.0 is installed: "
                     "every patch is skipped (installed: vllm 0.34.0, vllm-omni 0.32.0rc1); run `drama3-patches "
                     "doctor` for what to do"], proc.stderr


def test_inside_the_range_nothing_is_said(tmp_path):
    proc = _run(tmp_path, "0.32.0")
    assert proc.stdout.strip() == "hello x! [patched]"
    assert "reviewed for" not in proc.stderr
