"""Tier 1: manifest validation, the shipped manifest, and the `drama3-patches` command line."""

from __future__ import annotations

import copy
import json
import os

import pytest
import yaml

from drama3_patches._bootstrap import scan_target_modules
from drama3_patches.engine.state import host_label
from drama3_patches.manifest import ManifestError, load_manifest, parse_manifest
from support.replicas import PIL_QWEN2VL_ENV, PIL_QWEN2VL_PATH
from support.selftest import write_manifest, write_target
from support.subproc import ROOT, call, run_cli

SHIPPED = ROOT / "patches_manifest.yaml"
CONTRACT_IDS = [
    "runner-selection", "lora-count-forwarding", "mamba-prefill-end", "qwen3next-eager-attention",
    "tower-sampler-eager", "preemption-host-copy", "fp8-expert-method",
]
# Added for the published fish_omni (its GDN swap is CUDA-only; its tensor-parallel refusal and
# whole-head tower), for Ray actors on several nodes and for /metrics; beyond the original contract.
EXTRA_IDS = ["gdn-backbone-ascend", "fish-omni-tensor-parallel", "fish-omni-tp-frames-check",
             "fish-omni-tower-tp-split", "ray-actor-env", "metrics-endpoint"]


def test_shipped_manifest_is_valid_and_has_the_contract_ids():
    m = load_manifest(SHIPPED)
    assert list(m.ids) == CONTRACT_IDS + EXTRA_IDS
    for p in m.patches:
        assert p.implementation.startswith("drama3_patches.patches.")
        for text in (p.why, p.how, p.upstream, p.remove_when):
            assert "TODO" not in text, f"{p.id} has an unfinished review record"


def test_shipped_implementations_exist():
    import importlib

    for p in load_manifest(SHIPPED).patches:
        module, func = p.implementation.split(":")
        assert callable(getattr(importlib.import_module(module), func)), p.id


def _words(text: str) -> list[str]:
    return "".join(c.lower() if c.isalnum() else " " for c in text).split()


def test_patch_docstrings_point_to_their_record_without_restating_it():
    """One record per patch: the module names its manifest entry; no 10-word run of why/how repeats."""
    import ast

    for p in load_manifest(SHIPPED).patches:
        module = p.implementation.split(":")[0]
        path = ROOT / (module.replace(".", "/") + ".py")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "``patches_manifest.yaml``" in doc and f"id ``{p.id}``" in doc, (p.id, doc[:200])
        doc_words = " ".join(_words(doc))
        for fld in ("why", "how", "upstream", "remove_when"):
            words = _words(getattr(p, fld))
            runs = {" ".join(words[i:i + 10]) for i in range(len(words) - 9)}
            repeated = sorted(r for r in runs if r in doc_words)
            assert not repeated, (p.id, fld, repeated[:1])


def test_bootstrap_scan_agrees_with_yaml():
    text = SHIPPED.read_text()
    from_yaml = []
    for entry in yaml.safe_load(text)["patches"]:
        for t in entry["targets"]:
            mod = t.split(":")[0]
            if mod not in from_yaml:
                from_yaml.append(mod)
    assert scan_target_modules(text) == from_yaml


GOOD = {
    "id": "x", "summary": "s", "targets": ["a.b:C.d"], "requires": {"vllm": ">=0.31"},
    "platforms": ["npu"], "implementation": "drama3_patches.patches.selftest:plan",
    "why": "w", "how": "h", "upstream": "u", "remove_when": "r",
}


@pytest.mark.parametrize("change,field,fragment", [
    ({"targets": ["a.b.C.d"]}, "targets", "not of the form"),
    ({"targets": ["a-b:C"]}, "targets", "is not a dotted module name"),
    ({"targets": []}, "targets", "non-empty list"),
    ({"requires": {"vllm": ">=>0.3"}}, "requires", "vllm"),
    ({"platforms": ["tpu"]}, "platforms", "'tpu' is not one of"),
    ({"implementation": "os.path:join"}, "implementation", "names code outside drama3_patches.patches"),
    ({"why": ""}, "why", "missing or empty"),
    ({"remove_when": None}, "remove_when", "missing or empty"),
    ({"colour": "red"}, "colour", "unknown field"),
])
def test_malformed_entry_names_file_id_and_field(change, field, fragment):
    entry = {**GOOD, **change}
    text = yaml.safe_dump({"patches": [entry]})
    with pytest.raises(ManifestError) as err:
        parse_manifest(text, "some/manifest.yaml")
    msg = str(err.value)
    assert msg.startswith("some/manifest.yaml: patch 'x': field ")
    assert f"field {field!r}" in msg and fragment in msg


def test_duplicate_ids_and_bad_yaml():
    with pytest.raises(ManifestError, match="patch 'x': field 'id': used by two entries"):
        parse_manifest(yaml.safe_dump({"patches": [GOOD, copy.deepcopy(GOOD)]}), "m.yaml")  # no YAML alias
    with pytest.raises(ManifestError, match="m.yaml: not valid YAML"):
        parse_manifest("patches: [", "m.yaml")
    with pytest.raises(ManifestError, match="^/nonexistent/drama3/manifest.yaml: cannot read manifest: "):
        load_manifest("/nonexistent/drama3/manifest.yaml")


# -- the command line -----------------------------------------------------------

@pytest.fixture
def sandbox(tmp_path):
    write_target(tmp_path)
    manifest = write_manifest(tmp_path, {"targets": ["d3p_target:greet", "d3p_target:Greeter.hi"]},
                              {"id": "npu-only", "targets": ["d3p_target:Greeter.make"], "platforms": "[npu]"})
    return {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest)}, [tmp_path]


def test_status_json_after_import_targets(sandbox):
    env, path = sandbox
    proc = run_cli("status", "--json", "--import-targets", env=env, pythonpath=path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) >= {"enabled", "platform", "versions", "patches"}
    assert data["enabled"] is True
    by_id = {p["id"]: p for p in data["patches"]}
    assert by_id["selftest"]["state"] == "applied"
    assert by_id["selftest"]["targets"] == ["d3p_target:greet", "d3p_target:Greeter.hi"]
    assert by_id["npu-only"]["state"] == "skipped"
    assert "platform" in by_id["npu-only"]["reason"]


def test_status_table_and_unimportable_targets(sandbox, tmp_path):
    env, path = sandbox
    proc = run_cli("status", "--import-targets", env=env, pythonpath=path)
    assert proc.returncode == 0
    assert "selftest" in proc.stdout and "applied" in proc.stdout

    # Default (shipped) manifest on this host, dry-run as npu: a patch whose distributions are
    # not installed or out of range is skipped and says which; the fish_omni patches apply on the
    # real vLLM-Omni 0.32.0rc1; nothing fails (no drift between the manifest and the real pair).
    proc = run_cli("status", "--json", "--import-targets", pythonpath=PIL_QWEN2VL_PATH,
                   env={"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "npu", **PIL_QWEN2VL_ENV})
    assert proc.returncode == 0, proc.stderr
    from drama3_patches.versions import check

    applied_here = {"tower-sampler-eager", "preemption-host-copy", "gdn-backbone-ascend", "fish-omni-tensor-parallel",
                    "fish-omni-tp-frames-check", "fish-omni-tower-tp-split"}
    for p in json.loads(proc.stdout)["patches"]:
        unmet = [why for ok, why in (check(d, s) for d, s in load_manifest(SHIPPED).get(p["id"]).requires.items())
                 if not ok]
        if unmet:
            assert p["state"] == "skipped" and p["reason"] == unmet[0], p
        elif p["id"] in applied_here:
            assert p["state"] == "applied", p
        elif p["id"] == "qwen3next-eager-attention":
            # vLLM's own platform check already keeps the fused kernel off on this host.
            assert p["state"] == "not-needed" and "neither CUDA nor XPU" in p["reason"], p
        else:
            assert p["state"] in {"applied", "not-needed"}, p


def test_status_exit_1_when_a_patch_failed(sandbox, tmp_path):
    write_target(tmp_path, "d3p_broken", "def broken():\n    return 1\n")
    manifest = write_manifest(tmp_path, {"targets": ["d3p_broken:broken"]})
    proc = run_cli("status", "--import-targets",
                   env={"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest)}, pythonpath=[tmp_path])
    assert proc.returncode == 1
    assert "failed" in proc.stdout and "self-test failure requested" in proc.stdout


def test_disabled_status_says_why():
    proc = run_cli("status", "--json")
    assert proc.returncode == 0
    data = json.loads(proc.stdout)
    assert data["enabled"] is False
    assert {p["state"] for p in data["patches"]} == {"skipped"}
    assert all("DRAMA3_PATCHES is not enabled" in p["reason"] for p in data["patches"])


def test_list_and_verbose():
    proc = run_cli("list")
    assert proc.returncode == 0
    for pid in CONTRACT_IDS:
        assert f"{pid}:" in proc.stdout
    verbose = run_cli("list", "--verbose").stdout
    assert "why:" in verbose and "remove when:" in verbose and "upstream:" in verbose


def test_usage_errors_exit_2():
    assert run_cli("frobnicate").returncode == 2
    assert run_cli().returncode == 2
    assert run_cli("status", "--bogus").returncode == 2


def test_broken_manifest_is_one_clear_line(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text(yaml.safe_dump({"patches": [{**GOOD, "platforms": ["tpu"]}]}))
    proc = run_cli("status", env={"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(bad)})
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"{bad}: patch 'x': field 'platforms'" in proc.stderr


def a_patched_process() -> str:
    """Runs in a fresh interpreter: imports the target (patched, so a report is written)."""
    import d3p_target  # noqa: F401

    return str(os.getpid())


def test_collect_aggregates_reports_and_skips_corrupt_files(sandbox, tmp_path):
    env, path = sandbox
    reports = tmp_path / "reports"
    env = {**env, "DRAMA3_PATCHES_REPORT_DIR": str(reports)}
    pids = [call(a_patched_process, env=env, pythonpath=path) for _ in range(2)]
    (reports / "999999.json").write_text("{not json")
    (reports / "999998.json").write_text(json.dumps({"patches": "nope"}))
    proc = run_cli("status", "--collect", str(reports))
    assert proc.returncode == 0, proc.stderr
    for pid in pids:
        assert pid in proc.stdout
    assert "2 process report(s)" in proc.stdout
    here = host_label()
    assert f"selftest: applied in {', '.join(f'{here}:{p}' for p in sorted(pids, key=int))}" in proc.stdout
    assert f"host {here} (this host)" in proc.stdout
    assert "999999.json: not valid JSON" in proc.stderr
    assert "999998.json: no 'patches' list" in proc.stderr
    assert "Traceback" not in proc.stderr
    data = json.loads(run_cli("status", "--collect", str(reports), "--json").stdout)
    assert len(data["processes"]) == 2 and len(data["skipped"]) == 2


def test_collect_unreadable_directory_exit_2(tmp_path):
    proc = run_cli("status", "--collect", str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert "cannot read report directory" in proc.stderr and "Traceback" not in proc.stderr
    if os.geteuid() != 0:  # root reads a mode-000 directory anyway
        locked = tmp_path / "locked"
        locked.mkdir(mode=0)
        assert run_cli("status", "--collect", str(locked)).returncode == 2
