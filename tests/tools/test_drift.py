"""``drama3-patches drift`` on recorded source trees (tests/tools/drift_trees: extracts of the
vLLM 0.32.0 and 0.34.0 wheels, each file citing what it mirrors; and the vLLM-Ascend 0.30.0rc2
stand-in, tests/replicas/ascend_030rc2, whose mamba override has the sdist's syntax tree):
runner-selection is affected on 0.34.0 (Model Runner V1 removed), metrics-endpoint's target is as
reviewed on both, mamba-prefill-end's as reviewed on the sdist when read beside a vLLM tree; and
the manifest's recorded fingerprints match the installed wheels.

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
A030 = ROOT / "tests" / "replicas" / "ascend_030rc2"
MAMBA = "vllm_ascend.patch.platform.patch_mamba_manager:AscendMambaManager.get_num_blocks_to_allocate"
METRICS = "vllm.entrypoints.serve.instrumentator.metrics:attach_router"
V1_RUNNER = "vllm.v1.worker.gpu_model_runner"


def report(tree: Path, *more: Path) -> dict:
    manifest = load_manifest(ROOT / "patches_manifest.yaml")
    trees = [str(t) for t in (tree, *more)]
    out = drift_tool.drift(trees, manifest, drift_tool.versions_of(trees))
    return {p["id"]: p for p in out["patches"]}


def test_tree_versions_come_from_the_dist_info_folders():
    assert drift_tool.tree_versions(str(T032)) == {"vllm": "0.32.0"}
    assert drift_tool.tree_versions(str(T034)) == {"vllm": "0.34.0"}


def test_an_unpacked_sdist_gives_its_version_from_pkg_info(tmp_path):
    """An unpacked sdist has no .dist-info: its PKG-INFO's headers name the project and version."""
    (tmp_path / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: vllm_ascend\nVersion: 0.30.0rc2\n"
                                       "Summary: x\n\nVersion: 9.9 (the description, not a header)\n")
    assert drift_tool.tree_versions(str(tmp_path)) == {"vllm-ascend": "0.30.0rc2"}
    # negative control: a PKG-INFO naming another project gives nothing
    (tmp_path / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: other\nVersion: 1.0\n\n")
    assert drift_tool.tree_versions(str(tmp_path)) == {}


def test_mamba_prefill_end_is_as_reviewed_on_the_ascend_sdist_read_beside_vllm():
    """The second tree adds vLLM-Ascend: mamba-prefill-end's target is found there and its
    fingerprint matches the manifest's record (taken from the published sdist's own file; this
    stand-in's override has the same syntax tree); with the vLLM tree alone it is not in the tree."""
    recorded = load_manifest(ROOT / "patches_manifest.yaml").get("mamba-prefill-end").reviewed_source[MAMBA]
    row = report(T034, A030)["mamba-prefill-end"]
    (target,) = row["targets"]
    assert row["verdict"] == "unchanged", row
    assert target["fingerprint"] == recorded["0.30.0rc2"]
    assert target["state"] == "unchanged: as reviewed on vllm-ascend 0.30.0rc2"
    # the guard reads both trees' versions: vLLM 0.34.0 is outside the patch's range, 0.30.0rc2 inside
    assert row["guard"]["refused"] == ["vllm 0.34.0 outside >=0.31.0,<0.33"]
    assert report(T034)["mamba-prefill-end"]["verdict"] == "not in this tree"


def test_an_ascend_method_that_takes_prefill_end_is_reported_changed(tmp_path):
    """Negative control: the signature upstream would fix (prefill_end added) is a changed target."""
    tree = tmp_path / "ascend"
    shutil.copytree(A030, tree)
    path = tree / "vllm_ascend" / "patch" / "platform" / "patch_mamba_manager.py"
    text = path.read_text()
    assert "apply_admission_cap: bool = False,\n" in text
    path.write_text(text.replace("apply_admission_cap: bool = False,\n",
                                 "apply_admission_cap: bool = False,\n        prefill_end: int = 0,\n", 1))
    row = report(T034, tree)["mamba-prefill-end"]
    assert row["verdict"] == "affected"
    assert row["targets"][0]["state"] == "changed since vllm-ascend 0.30.0rc2"


def test_reads_follow_the_private_helper_modules_a_patch_or_its_target_module_imports(tmp_path):
    """A patch's reads include those of the ``drama3_patches.patches._*`` helpers it imports (any
    import form) and of a target module of its own; a helper's helper and a public module are not
    followed (one level)."""
    pkg = tmp_path / "drama3_patches" / "patches"
    pkg.mkdir(parents=True)
    (pkg / "p.py").write_text("from ._h import X\ndef plan(ctx):\n    import drama3_patches.patches._i\n")
    (pkg / "_h.py").write_text("from vllm_ascend.a import B\nfrom drama3_patches.patches._deep import Z\n")
    (pkg / "_i.py").write_text("import vllm.c\n")
    (pkg / "_t.py").write_text("S = 'vllm_omni.d:E'\n")
    (pkg / "_deep.py").write_text("from vllm.never import Seen\n")
    assert drift_tool.reads("drama3_patches.patches.p:plan", root=str(tmp_path)) == ["vllm.c", "vllm_ascend.a:B"]
    assert drift_tool.reads("drama3_patches.patches.p:plan", root=str(tmp_path),
                            also=("drama3_patches.patches._t",)) == ["vllm.c", "vllm_ascend.a:B", "vllm_omni.d:E"]
    # negative control: a module that imports no helper reads only its own names
    assert drift_tool.reads("drama3_patches.patches._i:plan", root=str(tmp_path)) == ["vllm.c"]


def test_lora_count_forwarding_reads_what_its_runner_module_imports():
    """Its target lives in this package (the shared NPU Omni AR runner); the vLLM-Ascend and
    vLLM-Omni classes that runner builds on are the patch's reads."""
    spec = load_manifest(ROOT / "patches_manifest.yaml").get("lora-count-forwarding")
    names = drift_tool.reads(spec.implementation, also=tuple(t.module for t in spec.targets))
    assert "vllm_ascend.worker.v2.model_runner:NPUModelRunner" in names
    assert "vllm_omni.worker_v2.omni_ar_model_runner:OmniARModelRunner" in names


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


def test_the_command_reads_a_second_tree_for_vllm_ascend(tmp_path):
    from drama3_patches.tools import main

    out = tmp_path / "drift-out"
    assert main(["drift", "--tree", str(T034), "--tree", str(A030), "--out", str(out)]) == 0
    data = json.loads((out / "report.json").read_text())
    assert data["tree"] == {"versions": {"vllm": "0.34.0", "vllm-ascend": "0.30.0rc2"},
                            "packages": ["vllm", "vllm-ascend"]}
    md = (out / "report.md").read_text()
    assert md.startswith("# Drift against vllm 0.34.0, vllm-ascend 0.30.0rc2\n")
    assert "| `mamba-prefill-end` | unchanged | no: vllm 0.34.0 outside >=0.31.0,<0.33 |" in md


def test_a_tree_without_vllm_is_refused(tmp_path, capsys):
    from drama3_patches.tools import main

    assert main(["drift", "--tree", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no vllm package in" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    # vLLM-Ascend's tree alone is no vLLM tree either
    assert main(["drift", "--tree", str(A030), "--out", str(tmp_path / "o")]) == 2
    assert f"no vllm package in {A030}" in capsys.readouterr().err


@pytest.mark.vllm
def test_recorded_fingerprints_match_the_installed_wheels():
    """Each fingerprint the manifest records for the installed vLLM / vLLM-Omni version is the one
    the installed source gives (the record is read from the published wheels)."""
    import importlib.metadata as md

    checked = 0
    for spec in load_manifest(ROOT / "patches_manifest.yaml").patches:
        for target, versions in spec.reviewed_source.items():
            dist = drift_tool.PACKAGES[target.split(".")[0]]
            try:
                version = md.version(dist)
            except md.PackageNotFoundError:  # vLLM-Ascend: the 0.30.0rc2 stand-in holds its record (above)
                continue
            if version not in versions:
                continue
            got, where = fingerprint.of_target(fingerprint.root_of(target), target)
            assert got == versions[version], f"{spec.id}: {target} on {dist} {version}: {got} ({where})"
            checked += 1
    assert checked >= 3  # the installed pair has records
