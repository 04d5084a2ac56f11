"""Test tiers (see docs/design.md): markers `vllm`, `npu`, `ray`, `packaging`.

`vllm` skips where vllm is absent. `npu` skips only where torch_npu is absent; where it is
installed but unusable every `npu` test fails, naming the cause and the fix (support.tiers).
"""

from __future__ import annotations

import os
import sys

import pytest

from support import tiers

_NPU = pytest.StashKey()


def _npu_problem(config):
    # Probed once per run, in the parent: a forked test must not probe again.
    if _NPU not in config.stash:
        config.stash[_NPU] = tiers.npu_problem()
    return config.stash[_NPU]


def pytest_collection_modifyitems(config, items):
    vllm = tiers.vllm_problem()
    for item in items:
        if "vllm" in item.keywords and vllm:
            item.add_marker(pytest.mark.skip(reason=vllm))
        if "npu" in item.keywords:
            _npu_problem(config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before the skipif marks: the NPU verdict is what an `npu` test reports first.
    if "npu" in item.keywords:
        problem = _npu_problem(item.config)
        if problem and problem[0] == "fail":
            pytest.fail(problem[1], pytrace=False)
        if problem:
            # reported at the test, as a skip mark would be
            raise pytest.skip.Exception(problem[1], _use_item_location=True)


def pytest_report_header(config):
    from importlib import metadata

    def v(d):
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            return "-"

    lines = [f"drama3-patches tiers: vllm {v('vllm')}, torch {v('torch')}, vllm-omni {v('vllm-omni')}, "
             f"vllm-ascend {v('vllm-ascend')}"]
    problem = _npu_problem(config)
    if problem:
        lines.append(f"npu tests: {'skipped' if problem[0] == 'skip' else 'FAIL'} ({problem[1]})")
    return lines


@pytest.fixture(autouse=True)
def _no_inherited_patch_env(monkeypatch):
    # The suite decides per test whether patches are on; never inherit the shell's.
    for name in list(os.environ):
        if name.startswith("DRAMA3_PATCHES"):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _one_thread_in_forks(request):
    # OpenMP's thread pool does not survive fork: a forked test whose parent already ran a
    # parallel torch op hangs in its first one, unless the child stays on one thread.
    if request.node.get_closest_marker("forked") and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
