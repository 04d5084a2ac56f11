"""fp8-expert-method's two routes on the cards (``pytest -m npu``): where the installed vLLM-Ascend
registers a block-FP8 MoE scheme (0.30.0rc2: ``AscendFp8BlockFusedMoEMethod``), the patch routes
Drama 3's routed experts to it by feature, and a seeded request served that way gives the frames
the CPU expansion (``DRAMA3_PATCHES_FP8_ROUTE=cpu``) gives.

Both routes end with bf16 experts resolved from the same FP8 weights and scales, loaded into
vLLM-Ascend's bf16 MoE method, so the same seed must draw the same frames; a difference means the
routes resolved different weights or left them in different layouts. What the CPU tiers cannot
show and this does: vLLM-Ascend's own ``process_weights_after_loading`` running on the device for
Drama 3's experts (the CPU tiers run the patch against a stand-in of 0.30.0rc2).

The model: ``DRAMA3_NPU_MODEL`` where set (the real checkpoint: the native route's load peak is then
what ``drama3-patches plan`` models, ``tools/plan/fp8_routes.py``), else a tiny published-format
checkpoint with block-FP8 experts made on the spot. Each engine runs in a fresh interpreter with
the engine enabled and strict (``support.subproc.call``).
"""

from __future__ import annotations

import json
import os

import pytest

from drama3_patches.tools.deploy_config import profiles
from support import e2e_pipeline as ep
from support.replicas import ASCEND_HOST_ENV
from support.subproc import call

pytestmark = pytest.mark.npu

DEPLOY = os.environ.get("DRAMA3_NPU_DEPLOY") or str(profiles.profile_file("910b-tp2-ep"))
PATCH = "fp8-expert-method"


def scheme_name() -> str | None:
    """The block-FP8 MoE scheme the installed vLLM-Ascend registers, if any."""
    from drama3_patches.patches import fp8_expert_method as fp8

    scheme = fp8.block_fp8_moe_scheme()
    return scheme.__name__ if scheme is not None else None


def write_tiny_fp8(directory: str) -> str:
    """A tiny published-format checkpoint with block-FP8 experts (run in a child: it imports vLLM-Omni)."""
    from drama3_patches.tools import tiny_model

    return str(tiny_model.make(directory, fp8=True))


def _model(tmp_path) -> str:
    return os.environ.get("DRAMA3_NPU_MODEL") or call(write_tiny_fp8, str(tmp_path / "tiny-fp8"))


def _serve(model: str, route: str, tmp_path) -> tuple[dict, list]:
    """One seeded request served with ``DRAMA3_PATCHES_FP8_ROUTE=route`` ('' = by feature): its
    output (``ep.describe``) and the fp8-expert-method reason of every process that applied it."""
    reports = tmp_path / f"reports-{route or 'feature'}"
    env = {**ASCEND_HOST_ENV, "DRAMA3_PATCHES_REPORT_DIR": str(reports), "DRAMA3_PATCHES_FP8_ROUTE": route}
    run = call(ep.offline_child, model, DEPLOY, [ep.SEEDED], env=env, timeout=1800)
    (out,) = run["phases"][0]["outputs"]
    reasons = []
    for path in reports.glob("*.json"):
        for patch in json.loads(path.read_text())["patches"]:
            if patch["id"] == PATCH and patch["state"] == "applied":
                reasons.append(patch["reason"])  # "patched: route native|cpu: why", as status shows it
    return out, reasons


def test_native_route_is_taken_by_feature_and_draws_the_frames_of_the_cpu_expansion(tmp_path):
    scheme = call(scheme_name, env=ASCEND_HOST_ENV)
    if scheme is None:
        pytest.skip("this vLLM-Ascend registers no block-FP8 MoE scheme (0.30.0rc2 on has one)")
    model = _model(tmp_path)
    native, native_why = _serve(model, "", tmp_path)
    cpu, cpu_why = _serve(model, "cpu", tmp_path)
    # the route each worker that loaded the experts took, as status shows it
    assert native_why and all(r.startswith("patched: route native: ") and scheme in r for r in native_why), native_why
    assert cpu_why and all(r == "patched: route cpu: DRAMA3_PATCHES_FP8_ROUTE=cpu" for r in cpu_why), cpu_why
    for out in (native, cpu):
        assert out["finite"] and out["frames"] > 0, out
    assert (native["frames"], native["sha256"]) == (cpu["frames"], cpu["sha256"])
