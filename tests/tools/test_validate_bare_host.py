"""``drama3-patches validate`` on a bare host: the package installed alone (its own dependencies,
no vLLM, no vLLM-Omni) in a scratch virtual environment. The host check answers before anything
starts: one line naming what is missing and the fix, exit 2, no traceback, nothing written."""

from __future__ import annotations

import subprocess
import venv

import pytest

from support.subproc import ROOT

pytestmark = pytest.mark.packaging


def test_a_bare_host_gets_one_line_naming_the_missing_vllm_and_exit_2(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    pip = subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          str(ROOT)], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    out = tmp_path / "out"
    done = subprocess.run([str(env_dir / "bin" / "drama3-patches"), "validate", "--profile", "910b-tp2-ep",
                           "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin"})
    print(done.stderr)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith("drama3-patches validate: this host cannot run a validation: vLLM is not installed")
    assert "fix: " in lines[0] and "vllm==" in lines[0]
    assert not out.exists() or not any(out.iterdir())  # nothing was started or written
