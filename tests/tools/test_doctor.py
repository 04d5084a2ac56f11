"""`drama3-patches doctor`: every verdict from given inputs, the NPU probe against stand-in
torch_npu packages in a child process, and the command on this (CPU) host."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from drama3_patches.tools import doctor

REPO = Path(__file__).resolve().parents[2]

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
    assert "[ok] vllm: 0.32.0 matches >=0.31,<0.34,>=0.32" in text
    assert "cuda-only" not in text  # a CUDA-only patch's range does not concern an NPU host


@pytest.mark.parametrize("case,line,fix", [
    ("env_unset", "DRAMA3_PATCHES is not set in this shell", "export DRAMA3_PATCHES=1"),
    ("env_bad", "DRAMA3_PATCHES='maybe' leaves the patches off", "export DRAMA3_PATCHES=1"),
    ("platform", "DRAMA3_PATCHES_PLATFORM=cpu overrides detection", "unset DRAMA3_PATCHES_PLATFORM"),
    ("no_pth", "no drama3_patches.pth in", "pip install --force-reinstall --no-deps drama3-patches"),
    ("bad_pth", "does not import drama3_patches._bootstrap", "pip install --force-reinstall --no-deps"),
    ("no_ep", "no drama3_patches entry point in vllm.general_plugins", "pip install --force-reinstall"),
    ("wrong_ep", "drama3_patches points at elsewhere:register", "pip install --force-reinstall"),
    ("old_vllm", "0.31.2 is outside the range of b (these patches would be skipped)",
     'VLLM_TARGET_DEVICE=empty pip install --no-binary vllm "vllm>=0.31,<0.34,>=0.32"'),
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
        kw["versions"] = {"vllm": "0.31.2"}
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


def _fake_torch_npu(tmp_path, body):
    d = tmp_path / "fake"
    (d / "torch_npu").mkdir(parents=True)
    (d / "torch_npu" / "__init__.py").write_text(body)
    return d


def _probe_with(path):
    code = "import json; from drama3_patches.tools import doctor; print(json.dumps(doctor.probe_npu(timeout=120)))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), str(REPO)]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    import json

    return json.loads(r.stdout.strip().splitlines()[-1])


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


def test_command_on_this_host():
    """On a host without torch_npu the doctor says not ready and how to fix it."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here: this test is for hosts without it")
    env = dict(os.environ, PYTHONPATH=str(REPO), ASCEND_RT_VISIBLE_DEVICES="0,1")
    env.pop("DRAMA3_PATCHES", None)
    r = subprocess.run([sys.executable, "-m", "drama3_patches.tools", "doctor"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0] == f"drama3-patches doctor: {sys.executable}"
    assert "  [FAIL] DRAMA3_PATCHES: DRAMA3_PATCHES is not set in this shell" in lines
    i = lines.index("  [FAIL] torch-npu: torch_npu is not installed; ASCEND_RT_VISIBLE_DEVICES=0,1")
    assert lines[i + 1].startswith('         fix: pip install "torch-npu')
    assert lines[-1].startswith("not ready: ")
    env["DRAMA3_PATCHES"] = "1"
    r = subprocess.run([sys.executable, "-m", "drama3_patches.tools", "doctor"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert "  [ok] DRAMA3_PATCHES: DRAMA3_PATCHES=1 in this shell" in r.stdout.splitlines()


@pytest.mark.npu
def test_doctor_ready_on_an_ascend_host():
    rc, text = _report(doctor.run_checks())
    assert rc == 0, text
