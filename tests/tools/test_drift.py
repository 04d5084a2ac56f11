"""``drama3-patches drift`` on two recorded source trees (tests/tools/drift_trees: extracts of the
vLLM 0.32.0 and 0.34.0 wheels, each file citing what it mirrors): runner-selection is affected on
0.34.0 (Model Runner V1 removed), metrics-endpoint's target is as reviewed on both; and the
manifest's recorded fingerprints match the installed wheels.

The reference fingerprints are the manifest's, recorded from the published wheels, not computed
from the trees here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from drama3_patches.tools import fingerprint
from drama3_patches.manifest import load_manifest
from drama3_patches.tools import drift as drift_tool
from support.subproc import ROOT

TREES = Path(__file__).parent / "drift_trees"
T032, T034 = TREES / "vllm_0_32_0", TREES / "vllm_0_34_0"
METRICS = "vllm.entrypoints.serve.instrumentator.metrics:attach_router"
V1_RUNNER = "vllm.v1.worker.gpu_model_runner"


def report(tree: Path) -> dict:
    manifest = load_manifest(ROOT / "patches_manifest.yaml")
    out = drift_tool.drift(str(tree), manifest, drift_tool.tree_versions(str(tree)))
    return {p["id"]: p for p in out["patches"]}


def test_tree_versions_come_from_the_dist_info_folders():
    assert drift_tool.tree_versions(str(T032)) == {"vllm": "0.32.0"}
    assert drift_tool.tree_versions(str(T034)) == {"vllm": "0.34.0"}


def test_runner_selection_is_affected_on_0_34_because_model_runner_v1_is_gone():
    """On 0.34.0 the V1 runner module runner-selection reads is absent and the patch is affected; on
    0.32.0 (negative control) the same read exists and nothing else of the patch is in the tree."""
    new, old = report(T034)["runner-selection"], report(T032)["runner-selection"]
    assert new["verdict"] == "affected"
    assert [r["name"] for r in new["reads"] if r["state"] == "absent"] == [V1_RUNNER]
    assert old["verdict"] == "not in this tree"  # not affected; no target of it to call unchanged
    assert {r["name"]: r["state"] for r in old["reads"]}[V1_RUNNER] == "exists"
    # its targets are vLLM-Omni's: neither tree holds them
    assert {t["state"] for t in new["targets"]} == {"not in this tree"}


def test_metrics_endpoint_is_unchanged_on_both_trees():
    manifest = load_manifest(ROOT / "patches_manifest.yaml")
    recorded = manifest.get("metrics-endpoint").reviewed_source[METRICS]
    assert recorded  # the review record holds the reviewed versions' fingerprints
    for tree in (T032, T034):
        row = report(tree)["metrics-endpoint"]
        (target,) = row["targets"]
        assert row["verdict"] == "unchanged", tree
        assert target["fingerprint"] == recorded["0.32.0"]
        assert target["state"] == "unchanged: as reviewed on vllm " + ", ".join(sorted(recorded))


def test_the_guard_is_reported_from_the_tree_versions():
    assert report(T032)["metrics-endpoint"]["guard"] == {"takes": True, "refused": []}
    assert report(T034)["metrics-endpoint"]["guard"] == {
        "takes": False, "refused": ["vllm 0.34.0 outside >=0.31.0,<0.33"]}


def _copy_with(tmp_path: Path, old: str, new: str) -> Path:
    tree = tmp_path / "tree"
    shutil.copytree(T034, tree)
    path = tree / "vllm" / "entrypoints" / "serve" / "instrumentator" / "metrics.py"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return tree


def test_a_changed_target_body_is_reported_changed(tmp_path):
    """Negative control of the fingerprint: one excluded handler more makes the target changed."""
    tree = _copy_with(tmp_path, '"/ping",', '"/ping", "/other",')
    row = report(tree)["metrics-endpoint"]
    assert row["verdict"] == "affected"
    assert row["targets"][0]["state"] == "changed since vllm 0.32.0"


def test_comments_docstrings_and_layout_do_not_count(tmp_path):
    tree = _copy_with(tmp_path, '"""Mount prometheus metrics to a FastAPI app."""',
                      '"""Another docstring."""  # and a comment\n\n')
    assert report(tree)["metrics-endpoint"]["verdict"] == "unchanged"


def test_a_missing_target_is_named(tmp_path):
    tree = _copy_with(tmp_path, "def attach_router(", "def attach_other_router(")
    row = report(tree)["metrics-endpoint"]
    assert row["verdict"] == "affected" and row["targets"][0]["state"] == "name absent"


def test_the_command_writes_both_reports_and_leaves_the_manifest_alone(tmp_path, monkeypatch):
    from drama3_patches.tools import main

    manifest = ROOT / "patches_manifest.yaml"
    before = manifest.read_bytes()
    monkeypatch.setenv("DRAMA3_PATCHES_MANIFEST", str(manifest))
    out = tmp_path / "drift-out"
    assert main(["drift", "--tree", str(T034), "--out", str(out)]) == 0
    assert manifest.read_bytes() == before
    data = json.loads((out / "report.json").read_text())
    assert data["tree"] == {"versions": {"vllm": "0.34.0"}, "packages": ["vllm"]}
    rows = {p["id"]: p["verdict"] for p in data["patches"]}
    assert rows["runner-selection"] == "affected" and rows["metrics-endpoint"] == "unchanged"
    md = (out / "report.md").read_text()
    assert "| `runner-selection` | affected | no: vllm 0.34.0 outside >=0.31.0,<0.33;" in md
    assert f"- reads, absent: `{V1_RUNNER}`" in md


def test_a_tree_without_vllm_is_refused(tmp_path, capsys):
    from drama3_patches.tools import main

    assert main(["drift", "--tree", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no vllm package in" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.vllm
def test_recorded_fingerprints_match_the_installed_wheels():
    """Each fingerprint the manifest records for the installed vLLM / vLLM-Omni version is the one
    the installed source gives (the record is read from the published wheels)."""
    import importlib.metadata as md

    checked = 0
    for spec in load_manifest(ROOT / "patches_manifest.yaml").patches:
        for target, versions in spec.reviewed_source.items():
            dist = drift_tool.PACKAGES[target.split(".")[0]]
            version = md.version(dist)
            if version not in versions:
                continue
            got, where = fingerprint.of_target(fingerprint.root_of(target), target)
            assert got == versions[version], f"{spec.id}: {target} on {dist} {version}: {got} ({where})"
            checked += 1
    assert checked >= 3  # the installed pair has records
