"""The launch table `plan --time` ships (``drama3_patches/tools/plan/launch_table.py``) equals what
the real engine dispatches: ``support.dispatch`` (``benchmarks/dispatch.py``'s counter) on the
published-depth tiny checkpoint, platform forced to npu, batch 1 and 64, once with the tower
kernels' eager path and once with torch-npu's two fused norms stood in (two engine runs, several
minutes each on a small host).
"""

from __future__ import annotations

import pytest

from drama3_patches.tools.plan import launch_table
from support import dispatch
from support import e2e_pipeline as ep
from support.subproc import call

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    reason = ep.problem()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("launch_table")
    model = call(dispatch.write_published_model, str(work / "model"), env=ep.env(patches=False),
                 pythonpath=[ep.SITE], timeout=900)
    out = {}
    for variant, extra in (("eager", {}), ("fused", {"DRAMA3_E2E_FUSED_STANDIN": "1"})):
        run = dispatch.measure(work / variant, batches=launch_table.BATCHES, frames=3, model=model, **extra)
        out[variant] = {b: dispatch.summarize(run["steps"], b) for b in launch_table.BATCHES}
    return out


def test_every_decode_step_of_a_batch_dispatched_the_same_ops(counted):
    assert {(v, b): s["identical"] for v, by in counted.items() for b, s in by.items()} == {
        (v, b): True for v in counted for b in launch_table.BATCHES}


def test_shipped_launch_table_equals_the_engines_count(counted):
    assert launch_table.from_summaries(counted) == launch_table.LAUNCHES
