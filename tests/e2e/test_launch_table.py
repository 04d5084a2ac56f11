"""The launch table `plan --time` ships (``drama3_patches/tools/plan/launch_table.py``) equals what
the real engine dispatches: ``support.dispatch`` (``benchmarks/dispatch.py``'s counter) on the
published-depth tiny checkpoint, platform forced to npu, batch 1 and 64, once with the tower
kernels' eager path and once with torch-npu's two fused norms stood in (the tier's two counting
engine runs, conftest.counted_runs, several minutes each on a small host).
"""

from __future__ import annotations

import pytest

from drama3_patches.tools.plan import launch_table

pytestmark = pytest.mark.e2e


def test_every_decode_step_of_a_batch_dispatched_the_same_ops(counted_runs):
    assert {(v, b): s["identical"] for v, by in counted_runs.items() for b, s in by.items()} == {
        (v, b): True for v in counted_runs for b in launch_table.BATCHES}


def test_shipped_launch_table_equals_the_engines_count(counted_runs):
    assert launch_table.from_summaries(counted_runs) == launch_table.LAUNCHES
