"""torch-npu's fused RMSNorm ops in the eager tower kernels, on the card (``pytest -m npu``).

The tower's calls at the published shapes (``support.tower_calls``, batch 1 and 64) run on the NPU
twice: on the fused path (``drama3_patches.kernels.npu_fused`` finds ``npu_rms_norm`` and
``npu_add_rms_norm``) and on the eager path (``DRAMA3_PATCHES_NPU_FUSED=0``). The results must
agree within the tolerance, and the frame's launches stay within the budget, that
tests/kernels/test_npu_fused_path.py holds the CPU stand-ins to (both from ``support.fused_path``).
Before either, the ops must pass the package's own self-check on the card (``npu_fused``: arity,
shapes, closeness to the eager norm) for every dtype they are offered for, and the self-check must
reject a wrapper of the real op that returns ``y`` alone, and one that gives it a wrong weight
(a value failure, in every dtype).

Each check runs in a fresh interpreter (``subproc.call``): the device runtime never starts in
the test process, which forks for other tests.
"""

from __future__ import annotations

import logging
import os

import pytest

from support.subproc import call
from support.tiers import TORCH_ABSENT

pytest.importorskip("torch", reason=TORCH_ABSENT)
from drama3_patches.kernels.npu_fused import FUSED_DTYPES  # noqa: E402
from support.fused_path import BATCHES, PER_FRAME  # noqa: E402  (imports torch)

pytestmark = pytest.mark.npu


_FAILED_SELF_CHECK = ("torch-npu's fused norms failed the self-check on bfloat16 (its warning names why): "
                      "the fused path never ran")


def _fused_or_skip(out: dict) -> None:
    if not out["fused"]:
        pytest.skip(f"torch_npu {out['torch_npu']} has no npu_rms_norm/npu_add_rms_norm: the kernels stay eager")


def test_fused_norms_pass_their_self_check_on_the_card():
    out = call(self_check_on_card)
    _fused_or_skip(out)
    assert out["proven"] == {str(dtype): True for dtype in FUSED_DTYPES}, out["log"]
    # the check can fail here: the real op with torch-npu's arity taken away is refused, once
    assert out["row_only_proven"] is False, out["row_only_log"]
    assert len(out["row_only_log"]) == 1 and "npu_rms_norm returned" in out["row_only_log"][0], out["row_only_log"]
    # and the real op computing with a wrong weight fails on its values, in every dtype
    assert out["wrong_weight_proven"] == {str(dtype): False for dtype in FUSED_DTYPES}, out["wrong_weight_log"]
    assert len(out["wrong_weight_log"]) == len(FUSED_DTYPES), out["wrong_weight_log"]
    assert all("npu_rms_norm's y differs from the eager gemma norm" in ln for ln in out["wrong_weight_log"])


@pytest.mark.parametrize("batch", BATCHES, ids=[f"batch{b}" for b in BATCHES])
def test_fused_norms_on_the_card_agree_with_the_eager_path_at_tower_shapes(batch):
    out = call(fused_against_eager, batch)
    _fused_or_skip(out)
    assert out["proven"], _FAILED_SELF_CHECK
    assert out["eager_path"], "the opt-out did not switch the kernels to the eager path"
    assert out["mismatches"] == {}, out["deviation"]
    # the residual variants' sums (x + residual, or + the masked code row, in x's dtype) and the gate
    assert out["other_mismatches"] == {}, out["deviation"]


@pytest.mark.parametrize("batch", BATCHES, ids=[f"batch{b}" for b in BATCHES])
def test_fused_path_launches_per_frame_on_the_card_within_the_budget(batch):
    out = call(launches_on_card, batch)
    _fused_or_skip(out)
    assert out["proven"], _FAILED_SELF_CHECK
    assert out["fused_ops"] > 0, out["per_call"]  # the fused path ran
    assert out["frame"] <= PER_FRAME[batch], out["per_call"]


def _torch_npu_state() -> dict:
    """Whether the detection found both ops, and whether they passed the self-check on bfloat16."""
    import torch
    import torch_npu

    from drama3_patches.kernels import npu_fused

    npu = torch.device("npu")
    fused = npu_fused.fused_norms(npu)
    return {"fused": fused is not None, "proven": fused is not None and fused.proven(npu, torch.bfloat16),
            "torch_npu": getattr(torch_npu, "__version__", "?")}


def self_check_on_card() -> dict:
    """The self-check's verdict for each dtype on the real ops, and on the real ``npu_rms_norm``
    made to return ``y`` alone, with what each logged."""
    import torch
    import torch_npu

    from drama3_patches.kernels import npu_fused
    from support.logs import captured

    with captured(npu_fused.logger.name, logging.INFO) as lines:
        out = _torch_npu_state()  # bfloat16 first, as the tower asks
        if not out["fused"]:
            return out
        npu = torch.device("npu")
        fused = npu_fused.fused_norms(npu)
        out["proven"] = {str(dtype): fused.proven(npu, dtype) for dtype in FUSED_DTYPES}
    out["log"] = list(lines)
    row_only = npu_fused.FusedNorms(lambda x, gamma, eps: torch_npu.npu_rms_norm(x, gamma, eps)[0],
                                    torch_npu.npu_add_rms_norm)
    with captured(npu_fused.logger.name, logging.WARNING) as lines:
        out["row_only_proven"] = row_only.proven(npu, torch.bfloat16)
        row_only.proven(npu, torch.bfloat16)
    out["row_only_log"] = list(lines)
    # the real op given a wrong weight (gamma = w, the 1 of Gemma's 1 + w left out): values only
    wrong_weight = npu_fused.FusedNorms(lambda x, gamma, eps: torch_npu.npu_rms_norm(x, gamma - 1, eps),
                                        torch_npu.npu_add_rms_norm)
    with captured(npu_fused.logger.name, logging.WARNING) as lines:
        out["wrong_weight_proven"] = {str(dtype): wrong_weight.proven(npu, dtype) for dtype in FUSED_DTYPES}
    out["wrong_weight_log"] = list(lines)
    return out


def _run(calls: dict, names) -> dict:
    import torch

    out = {}
    for name in names:
        kernel, args, kwargs = calls[name]
        result = kernel(*args, **kwargs)
        out[name] = [t.cpu() for t in (result if isinstance(result, tuple) else (result,))]
    torch.npu.synchronize()
    return out


def fused_against_eager(batch: int) -> dict:
    """Each norm call's outputs on the fused path and with the opt-out set, compared on the host."""
    from drama3_patches import env
    from support.fused_path import FUSED_KERNELS, assert_bf16_close
    from support.tower_calls import tower_calls

    out = _torch_npu_state()
    if not out["proven"]:
        return out
    import torch

    from drama3_patches.kernels import npu_fused

    calls = tower_calls(batch, device="npu")
    fused = _run(calls, FUSED_KERNELS)
    # the opt-out is read once per process, with the detection: forget it to read it again
    os.environ[env.NPU_FUSED] = "0"
    npu_fused._BACKENDS.clear()
    try:
        out["eager_path"] = npu_fused.fused_norms(torch.device("npu")) is None
        eager = _run(calls, FUSED_KERNELS)
    finally:
        del os.environ[env.NPU_FUSED]
        npu_fused._BACKENDS.clear()
    out.update(mismatches={}, other_mismatches={}, deviation={})
    for name in FUSED_KERNELS:
        # normalised outputs: q and k of the QK kernel, the first of the others; then sums and gate
        normalised = 2 if name == "fused_qk_rmsnorm_rope_gate" else 1
        for i, (got, want) in enumerate(zip(fused[name], eager[name])):
            key = f"{name}[{i}]"
            out["deviation"][key] = (got.float() - want.float()).abs().max().item()
            try:
                assert_bf16_close(got, want)
            except AssertionError as exc:
                out["mismatches" if i < normalised else "other_mismatches"][key] = str(exc)
    return out


def launches_on_card(batch: int) -> dict:
    """Per-call launches on the fused path, counted by ``support.launches`` on NPU tensors."""
    from support.fused_path import frame_launches
    from support.launches import count
    from support.tower_calls import tower_calls

    out = _torch_npu_state()
    if not out["proven"]:
        return out
    counts = {}
    for name, (kernel, args, kwargs) in tower_calls(batch, device="npu").items():
        kernel(*args, **kwargs)  # first call: prepares the gammas
        counts[name] = count(kernel, *args, **kwargs)
    out["per_call"] = {name: dict(c.by_op) for name, c in counts.items()}
    out["fused_ops"] = sum(n for c in counts.values() for op, n in c.by_op.items() if "rms_norm" in op)
    out["frame"] = frame_launches(counts)
    return out
