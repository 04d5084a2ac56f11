"""`drama3-patches plan`'s two load routes for block-FP8 experts on a card without MXFP8
(drama3_patches/tools/plan/fp8_routes.py): vLLM-Ascend's native method (a layer's FP8 weights and
their resolved copy on the card at once) and the CPU expansion (the card holds only the final set)."""

from __future__ import annotations

import json

from drama3_patches.tools.plan import fp8_routes
from drama3_patches.tools.plan import model as planner
from drama3_patches.tools.plan.cards import GIB
from support.checkpoints import CFG, write_checkpoint
from support.subproc import run_cli


def test_route_peaks_follow_the_published_post_processing_layer_by_layer(tmp_path):
    write_checkpoint(tmp_path)
    ckpt = planner.load_checkpoint(str(tmp_path))
    shape = planner.model_shape(ckpt)
    H, I, E, L = CFG["hidden_size"], CFG["moe_intermediate_size"], CFG["num_experts"], CFG["num_hidden_layers"]
    assert (H, I, E, L) == (256, 256, 8, 4)  # the sums below are for this shape (block 128)
    scale = 2 * 2 * 4                       # one 256x256 projection: 2x2 float32 block scales
    w13_stored, w2_stored = E * 2 * (H * I + scale), E * (H * I + scale)
    w13_bf16, w2_bf16 = E * 2 * I * H * 2, E * H * I * 2
    layer_bf16 = w13_bf16 + w2_bf16
    # Last layer (the most resident before it): w13's resolved copy beside the layer's FP8, plus one
    # expert's resolved w13 and three float32 bands of min(1024, 2I) rows.
    stage13 = 2 * I * H * 2 + 3 * 4 * min(1024, 2 * I) * H
    native = 1000 + (L - 1) * layer_bf16 + (w13_stored + w2_stored) + w13_bf16 + stage13
    peaks = fp8_routes.route_peaks(planner.expert_layers(ckpt), shape, 1.0, 1000)
    assert peaks["native"] == native and peaks["native_at"] == "layer 3: w13 resolved beside its FP8 source"
    assert peaks["cpu"] == 1000 + L * layer_bf16
    assert peaks["cpu_host"] == L * (w13_stored + w2_stored)
    # Half the experts per card (EP over two cards): every expert term halves, the staging does not.
    half = fp8_routes.route_peaks(planner.expert_layers(ckpt), shape, 0.5, 1000)
    assert half["native"] == 1000 + ((L - 1) * layer_bf16 + w13_stored + w2_stored + w13_bf16) / 2 + stage13


def test_choose_takes_native_only_where_its_peak_fits():
    peaks = {"native": 10 * GIB, "cpu": 9 * GIB}
    assert fp8_routes.choose(peaks, 10 * GIB)[0] == "native"
    route, why = fp8_routes.choose(peaks, 9.5 * GIB)
    assert route == "cpu" and why == ("the native load peak 10.00 GiB exceeds the stage's 9.50 GiB: keep the CPU "
                                      "expansion with DRAMA3_PATCHES_FP8_ROUTE=cpu")


def test_plan_names_the_route_the_deploy_takes(tmp_path):
    write_checkpoint(tmp_path)
    big = run_cli("plan", str(tmp_path), "--card-gib", "64", "--json", "-q")
    routes = json.loads(big.stdout)["figures"]["fp8_routes"]
    assert routes["route"] == "native" and routes["native"] > routes["cpu"]
    # A card whose stage budget lies between the two peaks keeps the CPU expansion, and says so.
    gib = (routes["native"] + routes["cpu"]) / 2 / 0.9 / GIB
    small = run_cli("plan", str(tmp_path), "--card-gib", f"{gib:.6f}", "-q")
    assert "route taken: cpu: the native load peak" in small.stdout and "DRAMA3_PATCHES_FP8_ROUTE=cpu" in small.stdout
    assert "route taken: native" in run_cli("plan", str(tmp_path), "--card-gib", "64", "-q").stdout
    # A card with MXFP8 keeps FP8 experts: no bf16 routes to choose between.
    mx = run_cli("plan", str(tmp_path), "--card-gib", "64", "--mxfp8", "--json", "-q")
    assert "fp8_routes" not in json.loads(mx.stdout)["figures"]
