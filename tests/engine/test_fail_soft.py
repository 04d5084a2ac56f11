"""Tier 1: nothing of ours makes the host's import fail (outside DRAMA3_PATCHES_STRICT=1).

A broken manifest, an engine error or a failing vLLM plugin call becomes one warning and the
import proceeds unpatched; under STRICT=1 the same error is raised.  The start-up scan reads only
a regular file of bounded size: a FIFO, a device or a huge file is a warning, never a hang.
"""

from __future__ import annotations

import os

import pytest

from support.selftest import manifest_text, write_target
from support.subproc import ChildFailed, call, run_python

GOOD = manifest_text({"targets": ["d3p_target:greet", "d3p_other:other"]})
BROKEN = {
    # a target list the start-up scan reads, then text YAML refuses
    "invalid-yaml": (GOOD + "oops: [unclosed\n", "not valid YAML"),
    "misspelt-field": (GOOD.replace("platforms:", "platfroms:"), "field 'platfroms': unknown field"),
}


@pytest.fixture
def host(tmp_path):
    write_target(tmp_path)
    write_target(tmp_path, "d3p_other", "def other():\n    return 'other'\n")

    def env(text: str | None = None, **extra):
        manifest = tmp_path / "manifest.yaml"
        if text is not None:
            manifest.write_text(text)
        return {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest), **extra}

    env.root = tmp_path
    return env


def import_two_targets() -> list:
    """Runs in a fresh interpreter started as a serving process is (the .pth line active)."""
    import d3p_other
    import d3p_target

    return [d3p_target.greet("x"), d3p_other.other()]


def engine_bug() -> None:
    """Prelude: the engine fails at its first target, as a bug of ours would."""
    from drama3_patches.engine.core import Engine

    def on_import(self, module_name):
        raise RuntimeError("an engine bug (injected)")

    Engine.on_import = on_import


def vllm_loads_the_plugin() -> str:
    """What vLLM does in a process that skipped .pth files: call the general plugin (twice)."""
    import sys

    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "TriggerFinder"]
    from drama3_patches.plugin import register

    register()
    register()
    import d3p_target

    return d3p_target.greet("plugin")


def _warnings(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [ln for ln in stderr.splitlines() if ln.strip()]


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_manifest_is_one_warning_and_the_import_proceeds(host, case):
    text, cause = BROKEN[case]
    got = call(import_two_targets, env=host(text), pythonpath=[host.root], with_output=True)
    assert got["result"] == ["hello x!", "other"]
    (line,) = _warnings(got["stderr"])  # one warning for both target imports
    assert cause in line and "the import proceeds unpatched" in line and "DRAMA3_PATCHES_STRICT=1" in line


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_strict_raises_the_manifest_error(host, case):
    text, cause = BROKEN[case]
    with pytest.raises(ChildFailed) as failed:
        call(import_two_targets, env=host(text, DRAMA3_PATCHES_STRICT="1"), pythonpath=[host.root])
    assert "ManifestError" in failed.value.proc.stderr and cause in failed.value.proc.stderr


def test_an_engine_error_is_one_warning_and_the_import_proceeds(host):
    got = call(import_two_targets, env=host(GOOD), pythonpath=[host.root], prelude=engine_bug, with_output=True)
    assert got["result"] == ["hello x!", "other"]
    (line,) = _warnings(got["stderr"])
    assert "RuntimeError: an engine bug (injected)" in line
    with pytest.raises(ChildFailed) as failed:
        call(import_two_targets, env=host(GOOD, DRAMA3_PATCHES_STRICT="1"), pythonpath=[host.root],
             prelude=engine_bug)
    assert "an engine bug (injected)" in failed.value.last_error


def test_the_vllm_plugin_never_raises_into_vllm(host):
    text, cause = BROKEN["misspelt-field"]
    got = call(vllm_loads_the_plugin, env=host(text), pythonpath=[host.root], with_output=True)
    assert got["result"] == "hello plugin!"
    (line,) = _warnings(got["stderr"])
    assert cause in line
    with pytest.raises(ChildFailed) as failed:
        call(vllm_loads_the_plugin, env=host(text, DRAMA3_PATCHES_STRICT="1"), pythonpath=[host.root])
    assert "ManifestError" in failed.value.last_error
    # A good manifest: the plugin patches.
    assert call(vllm_loads_the_plugin, env=host(GOOD), pythonpath=[host.root]) == "hello plugin! [patched]"


def _fifo(path):
    os.mkfifo(path)
    return str(path)


def _huge(path):
    with open(path, "wb") as f:
        f.truncate(64 << 20)  # sparse: costs no disk, but a whole read would be 64 MiB
    return str(path)


def _not_utf8(path):
    path.write_bytes(GOOD.encode() + b"\n# caf\xe9\n")
    return str(path)


@pytest.mark.parametrize("make,why", [
    (_fifo, "not a regular file (a FIFO); a manifest must be one"),
    (lambda path: "/dev/zero", "not a regular file (a character device)"),
    (_huge, "over the 1.0 MiB limit for a manifest"),
    (_not_utf8, "not UTF-8 text"),
], ids=["fifo", "dev-zero", "huge", "not-utf8"])
def test_the_start_up_scan_reads_only_a_bounded_regular_file(host, make, why):
    manifest = make(host.root / "manifest.yaml")
    env = dict(host(), DRAMA3_PATCHES_MANIFEST=manifest)
    # Every interpreter start reads the manifest: it must not block, fill memory or print a traceback.
    proc = run_python("import d3p_target; print(d3p_target.greet('x'))", env=env, pythonpath=[host.root],
                      timeout=60)
    assert proc.stdout.strip() == "hello x!"
    (line,) = _warnings(proc.stderr)
    assert "cannot read the patch manifest" in line and why in line and "DRAMA3_PATCHES_MANIFEST" in line
