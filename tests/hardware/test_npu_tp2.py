"""Two Ascend cards, rank against rank (``pytest -m npu``): what the CPU tier cannot settle for
fish-omni-tensor-parallel and fish-omni-tower-tp-split.

* The split tower's output projection all-reduces over HCCL: both ranks must hold bit-identical
  tower outputs and draw the same codes (the CPU tier proves it for gloo only). Against TP1 on
  one card the difference is printed (the CPU tier bounds it; the cards' matmul tiling may add
  to it).
* The reference-codes broadcast and the frames check run on the group's CPU (gloo) group beside
  HCCL: rank 1 given other codes ends with rank 0's; under ``DRAMA3_PATCHES_TP_CHECK=1`` equal
  frames pass and a forced difference fails naming the step and the rank, with the frames on the
  cards.

Each rank is a fresh interpreter on its own card (``support.subproc.call_ranks``), the engine on
and strict, the platform detected. Needs two visible NPUs.
"""

from __future__ import annotations

import pytest

from support.replicas import ASCEND_HOST_ENV, PIL_QWEN2VL_ENV, PIL_QWEN2VL_PATH, has_fish_omni
from support.subproc import TESTS, _load, call_ranks

# The CPU tier's rank children, run here on the cards.
RANKS = str(TESTS / "patches" / "test_patch_fish_omni_tp_ranks.py")
AGREEMENT = str(TESTS / "patches" / "test_patch_fish_omni_tp.py")

pytestmark = [pytest.mark.npu,
              pytest.mark.skipif(not has_fish_omni(), reason="this vllm-omni has no fish_omni (Drama 3)")]


def _two_cards() -> None:
    import torch
    import torch_npu  # noqa: F401  (tests/conftest.py fails the run where it is installed but broken)

    if torch.npu.device_count() < 2:
        pytest.fail(f"these checks need two NPUs; {torch.npu.device_count()} visible (ASCEND_RT_VISIBLE_DEVICES)")


def test_split_tower_ranks_agree_over_hccl():
    _two_cards()
    tower_child, layouts = _load(RANKS, "tower_child"), _load(RANKS, "LAYOUTS")
    max_diff = _load(RANKS, "_max_diff")
    for layout in sorted(layouts):
        (one,) = call_ranks(tower_child, 1, layout, False, "npu", "hccl", env=ASCEND_HOST_ENV, timeout=1200)
        r0, r1 = call_ranks(tower_child, 2, layout, False, "npu", "hccl", env=ASCEND_HOST_ENV, timeout=1200)
        assert r0["states"]["fish-omni-tower-tp-split"] == "applied"
        assert r0["o_proj"] == r1["o_proj"] == "RowParallelOut"
        assert r0["hidden"] == r1["hidden"] and r0["codes"] == r1["codes"], layout
        print(f"{layout} on the cards: max |TP2 - TP1| {max_diff(one['hidden'], r0['hidden']):.4g}; "
              f"codes equal to TP1: {r0['codes'] == one['codes']}")


def agreement_on_cards_child() -> dict:
    """The patched _reference_codes and postprocess_model_output with frames on the rank's card."""
    import os

    import torch

    torch.npu.set_device(int(os.environ["DRAMA3_TEST_RANK"]))
    return _load(AGREEMENT, "agreement_child")(device="npu", backend="hccl")


def test_codes_broadcast_and_frames_check_on_two_cards():
    _two_cards()
    env = {**ASCEND_HOST_ENV, **PIL_QWEN2VL_ENV, "DRAMA3_PATCHES_TP_CHECK": "1"}
    r0, r1 = call_ranks(agreement_on_cards_child, 2, env=env, pythonpath=PIL_QWEN2VL_PATH, timeout=1200)
    rank0_codes = [[3 * i + j for j in range(3)] for i in range(4)]
    assert r0["codes"] == r1["codes"] == rank0_codes
    assert r0["none_on_rank0"] is None and r1["none_on_rank0"] is None
    for run in (r0, r1):
        assert run["second_step"].startswith("TensorParallelDrift: step 1: ")
        assert "rank(s) [1] differ from rank 0's" in run["second_step"]
