"""`drama3-patches plan --time` on a small fish_omni checkpoint this file writes.

Expected bytes and launches are computed here from the writer's tensor list (by the role the
writer gives each tensor), from the launch table's rows and from the model's stated formulas;
never by summing what the planner summed.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import replace

import pytest

from drama3_patches.tools.plan import calibrate, launch_table, timing
from drama3_patches.tools.plan import model as planner
from drama3_patches.tools.plan.cards import SPEEDS, lookup
from drama3_patches.tools.tiny_model import FISH_CFG, fish_tensor_specs, write_codec, write_fish_checkpoint
from support.plan_cli import plan_here as run_plan

BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
T, A = FISH_CFG["text_config"], FISH_CFG["audio_decoder_config"]
# Pure bandwidth: throughput so high that no term is compute-bound, so bytes alone set the device terms.
K = timing.Constants(hbm_gbps=100.0, bf16_tflops=1e9, fp32_tflops=1e9, link_gbps=10.0, link_latency_us=5.0,
                     launch_us=20.0, replay_us=7.0)
WL = timing.Workload(context_tokens=100)

# A DAC of the published layout in miniature: the quantizer's post transformer at the frame rate, one
# upsampling transposed conv (kernel = stride 2), the decoder's input conv, one block (snake, transposed
# conv of kernel 4 = twice its stride 2, one residual conv).
DAC_SPECS = [
    ("quantizer.post_module.layers.0.attention.wqkv.weight", (24, 8), "x"),
    ("quantizer.post_module.freqs_cis", (64, 4, 2), "x"),        # a buffer: no work
    ("quantizer.upsample.0.0.conv.weight", (8, 8, 2), "x"),
    ("quantizer.upsample.0.0.conv.bias", (8,), "x"),
    ("decoder.model.0.conv.parametrizations.weight.original0", (16, 1, 1), "x"),  # magnitude: baked
    ("decoder.model.0.conv.parametrizations.weight.original1", (16, 8, 7), "x"),
    ("decoder.model.1.block.0.alpha", (1, 16, 1), "x"),
    ("decoder.model.1.block.1.conv.parametrizations.weight.original1", (16, 8, 4), "x"),
    ("decoder.model.1.block.2.block.1.conv.parametrizations.weight.original1", (8, 8, 7), "x"),
    ("encoder.block.0.conv.weight_v", (8, 1, 7), "x"),                     # stage 0's: not the DAC stage's
]


def by_role(cfg=FISH_CFG):
    out = defaultdict(int)
    for name, dt, shape, role in fish_tensor_specs(cfg):
        out[role] += math.prod(shape) * BYTES[dt]
        if "embed_tokens" in name:
            out["embed_tokens"] += math.prod(shape) * BYTES[dt]
        if "embedding" in name:
            out["tower_gathered"] += math.prod(shape) * BYTES[dt]
    return out


@pytest.fixture(scope="module")
def fish(tmp_path_factory):
    d = tmp_path_factory.mktemp("fish_time") / "drama3"
    write_fish_checkpoint(d)
    write_codec(d / "codec.pth", DAC_SPECS)
    return d


def inputs_for(fish, tp=1, ep=False, card="910b1"):
    ckpt = planner.load_checkpoint(str(fish))
    opts = planner.Options(card=lookup(card), tp=tp, ep=ep, max_num_seqs=8, max_model_len=1024)
    plan = planner.make_plan(ckpt, opts)
    return timing.step_inputs(ckpt, plan, planner.checkpoint_sums(ckpt))


def ms(nbytes, k=K):
    return 1e3 * nbytes / (k.hbm_gbps * 1e9)


def test_weights_term_reads_the_dense_backbone_without_its_embedding_and_the_kept_head_rows(fish):
    by = by_role()
    rows = 1 + FISH_CFG["semantic_end_token_id"] - FISH_CFG["semantic_start_token_id"]
    expected = by["shard"] - by["embed_tokens"] + by["kv"] + by["rep"] + rows * T["hidden_size"] * 2
    level = timing.frame_time(inputs_for(fish), 1, "eager", K, WL)
    assert level["components_ms"]["weights"] == pytest.approx(ms(expected))
    # at TP2 the sharded tensors halve (2 KV heads: one per rank), the replicated ones do not
    shard2 = (by["shard"] - by["embed_tokens"]) / 2 + by["kv"] / 2 + by["rep"] + rows * T["hidden_size"] * 2
    level2 = timing.frame_time(inputs_for(fish, tp=2), 1, "eager", K, WL)
    assert level2["components_ms"]["weights"] == pytest.approx(ms(shard2))


@pytest.mark.parametrize("n", [1, 3, 64])
@pytest.mark.parametrize("tp,ep", [(1, False), (2, True)])
def test_experts_term_is_the_expected_share_of_experts_a_batch_routes_to(fish, n, tp, ep):
    L, E, k = T["num_hidden_layers"], T["num_experts"], T["num_experts_per_tok"]
    I, H = T["moe_intermediate_size"], T["hidden_size"]
    per_card = L * math.ceil(E / tp) * 3 * I * H * 2  # bfloat16 after expansion (910B: no MXFP8)
    share = 1 - (1 - k / E) ** n  # 2 of 8: n=1 -> 0.25, n=3 -> 0.578125
    level = timing.frame_time(inputs_for(fish, tp, ep), n, "eager", K, WL)
    assert level["components_ms"]["experts"] == pytest.approx(ms(per_card * share))
    assert timing.experts_used_share(1, 2, 8) == 0.25 and timing.experts_used_share(3, 2, 8) == 0.578125


def test_tower_term_reads_its_layers_and_heads_not_its_gathered_tables(fish):
    by = by_role()
    # eh_proj's embedding half becomes a code table (gathered), as the embeddings are
    expected = by["tower"] + by["tower_eh"] / 2 - by["tower_gathered"]
    level = timing.frame_time(inputs_for(fish), 1, "eager", K, WL)
    assert level["components_ms"]["tower"] == pytest.approx(ms(expected))


@pytest.mark.parametrize("n", [1, 5])
def test_kv_term_is_context_kv_tower_kv_and_state_read_and_written(fish, n):
    n_full = T["layer_types"].count("full_attention")
    n_lin = len(T["layer_types"]) - n_full
    kv_tok = n_full * 2 * T["num_key_value_heads"] * T["head_dim"] * 2
    tower_layers = A["shared_enrichment_layers"] + A["num_codebooks"] - 1
    tower_frame = tower_layers * 2 * A["n_local_heads"] * A["head_dim"] * 2 * A["num_codebooks"]
    nk, nv, dk, dv, c = (T[x] for x in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                         "linear_value_head_dim", "linear_conv_kernel_dim"))
    state = n_lin * ((2 * nk * dk + nv * dv) * (c - 1) + nv * dv * dk) * 2
    expected = n * (WL.context_tokens * kv_tok + tower_frame + 2 * state)
    level = timing.frame_time(inputs_for(fish), n, "eager", K, WL)
    assert level["components_ms"]["kv"] == pytest.approx(ms(expected))


def test_collectives_are_two_all_reduces_per_layer_and_one_per_split_tower_layer(fish):
    n, H = 4, T["hidden_size"]
    count = 2 * T["num_hidden_layers"] + A["shared_enrichment_layers"] + A["num_codebooks"] - 1
    per = K.link_latency_us / 1e3 + 1e3 * (2 * 1 / 2) * n * H * 2 / (K.link_gbps * 1e9)
    level = timing.frame_time(inputs_for(fish, tp=2, ep=True), n, "eager", K, WL)
    assert level["components_ms"]["collectives"] == pytest.approx(count * per)
    assert timing.frame_time(inputs_for(fish), n, "eager", K, WL)["components_ms"]["collectives"] == 0


def test_host_dispatch_counts_the_tables_launches_per_path(fish):
    inp = inputs_for(fish)
    L = T["num_hidden_layers"]
    fused = launch_table.LAUNCHES["fused"]
    b1 = {name: row[0] for name, row in fused.items()}
    everything = sum(b1.values())
    assert everything == 3152  # docs/recipe.md's whole step, fused norms, batch 1
    tower = sum(b1[c] for c in ("tower: shared layers", "tower: codebook layers", "tower: codebook heads",
                                 "sampler", "forward: frames and glue"))
    outside = b1["outside the forward"]
    cases = {"eager": (everything, 0), "piecewise": (2 * L + tower + outside, L + 1),
             "piecewise+tower": (2 * L + outside, L + 2)}
    for graph, (launches, replays) in cases.items():
        level = timing.frame_time(inp, 1, graph, K, WL)
        assert (level["launches"], level["replays"]) == (launches, replays), graph
        assert level["components_ms"]["host_dispatch"] == pytest.approx((launches * 20.0 + replays * 7.0) / 1e3)
    # at batch 64 the table's second column, between them a straight line
    b64 = sum(row[1] for row in fused.values())
    assert timing.frame_time(inp, 64, "eager", K, WL)["launches"] == b64 == 3279
    mid = timing.frame_time(inp, 32, "eager", K, WL)["launches"]
    assert mid == pytest.approx(3152 + (3279 - 3152) * 31 / 63)


def test_dac_work_per_audio_second_from_codec_shapes(fish):
    r = timing.FRAME_RATE
    flops = 2 * (24 * 8 * r + 8 * 8 * 2 * r + 16 * 8 * 7 * 2 * r + 16 * 8 * 4 * 2 * r + 8 * 8 * 7 * 4 * r)
    dac = inputs_for(fish).dac
    assert dac["flops_per_audio_s"] == pytest.approx(flops)
    assert dac["output_rate"] == pytest.approx(4 * r)
    assert dac["launches_per_chunk"] == 5 + timing.SNAKE_LAUNCHES  # five weights, one snake
    # float32 (the default) on a card of 1 GFLOPS: compute-bound, chunk of 64 with 32 of context again
    k = replace(K, fp32_tflops=1e-3)
    device, host = timing.dac_ms_per_audio_s(dac, k, WL)
    assert device == pytest.approx(1e3 * flops * 1.5 / 1e9)
    assert host == pytest.approx(dac["launches_per_chunk"] * r / 64 * 20.0 / 1e3)


def test_doubling_hbm_bandwidth_halves_device_terms_and_leaves_host_dispatch(fish):
    inp = inputs_for(fish, tp=2, ep=True)
    k0 = replace(K, link_latency_us=0.0, link_gbps=math.inf)
    for n in (1, 16):
        a = timing.frame_time(inp, n, "eager", k0, WL)["components_ms"]
        b = timing.frame_time(inp, n, "eager", replace(k0, hbm_gbps=2 * k0.hbm_gbps), WL)["components_ms"]
        assert b["host_dispatch"] == a["host_dispatch"] > 0
        for term in ("weights", "experts", "tower", "kv", "dac"):
            assert a[term] > 0 and b[term] == pytest.approx(a[term] / 2), term


def test_zero_launch_cost_leaves_only_device_time(fish):
    inp = inputs_for(fish, tp=2, ep=True)
    for graph in timing.GRAPHS:
        level = timing.frame_time(inp, 8, graph, replace(K, launch_us=0.0, replay_us=0.0), WL)
        assert level["components_ms"]["host_dispatch"] == 0
        assert level["step_ms"] == pytest.approx(sum(level["components_ms"][t] for t in timing.DEVICE_TERMS))
        assert level["bound"] != "host_dispatch"
    with_host = timing.frame_time(inp, 8, "eager", K, WL)
    assert with_host["step_ms"] > with_host["device_ms"]  # the control: with a launch cost, host binds


@pytest.mark.parametrize("graph", timing.GRAPHS)
def test_frame_time_never_falls_as_concurrency_grows(fish, graph):
    inp = inputs_for(fish, tp=2, ep=True)
    for k in (K, replace(K, launch_us=0.0, replay_us=0.0)):
        times = [timing.frame_time(inp, n, graph, k, WL)["ms_per_frame"] for n in range(1, 200)]
        assert all(b >= a for a, b in zip(times, times[1:]))
        assert times[-1] > times[0]


def test_fit_reads_only_the_concurrency_1_level(fish):
    inp = inputs_for(fish, tp=2, ep=True)
    levels = [{"max_concurrency": 1, "audio_throughput": 0.569}, {"max_concurrency": 16, "audio_throughput": 3.19},
              {"max_concurrency": 64, "audio_throughput": 7.20}]
    fitted = calibrate.fit_launch_us(inp, K, WL, calibrate.c1_frame_ms(levels))
    others = [levels[0]] + [dict(lv, audio_throughput=lv["audio_throughput"] * 10) for lv in levels[1:]]
    assert calibrate.fit_launch_us(inp, K, WL, calibrate.c1_frame_ms(others)) == fitted
    assert calibrate.fit_launch_us(inp, K, WL, calibrate.c1_frame_ms(levels[:1])) == fitted
    changed = [dict(levels[0], audio_throughput=0.6)] + levels[1:]  # the control: the c1 row moves it
    assert calibrate.fit_launch_us(inp, K, WL, calibrate.c1_frame_ms(changed)) != fitted
    # the fitted cost reproduces the measured frame time at concurrency 1
    level = timing.frame_time(inp, 1, "eager", replace(K, launch_us=fitted), WL)
    assert level["audio_s_per_s"] == pytest.approx(0.569)
    with pytest.raises(calibrate.FitError):
        calibrate.c1_frame_ms(levels[1:])


def test_fit_refuses_when_the_device_alone_is_slower_than_measured(fish):
    inp = inputs_for(fish)
    with pytest.raises(calibrate.FitError, match="device time"):
        calibrate.fit_launch_us(inp, replace(K, hbm_gbps=1e-3), WL, 46.4)




def test_json_gives_levels_per_graph_and_realtime_streams(fish):
    rc, out, err = run_plan(fish, "--card", "910b1", "--tp", "2", "--ep", "--time", "--json", "-q",
                            "--concurrency", "1,8", "--launch-us", "10")
    assert rc in (0, 1), err
    t = out["time"]
    assert [(lv["concurrency"], lv["graph"]) for lv in t["levels"]] == [
        (n, g) for g in timing.GRAPHS for n in (1, 8)]
    for lv in t["levels"]:
        assert set(lv["components_ms"]) == {"host_dispatch", "weights", "experts", "tower", "kv", "collectives", "dac"}
        assert lv["audio_s_per_s"] == pytest.approx(lv["concurrency"] * timing.FRAME_MS / lv["ms_per_frame"])
        assert lv["rtf"] == pytest.approx(lv["concurrency"] / lv["audio_s_per_s"])
        assert lv["bound"] in timing.COMPONENTS or lv["bound"].startswith("dac")
    assert set(t["realtime_streams"]) == set(timing.GRAPHS)
    assert t["constants"]["launch_us"] == 10 and t["fit"] is None
    assert t["constants"]["hbm_gbps"] == SPEEDS["910b1"].hbm_gbps
    rc, out, _ = run_plan(fish, "--card", "910b1", "--tp", "2", "--ep", "--time", "--json", "-q",
                          "--card-hbm-gbps", "123")
    assert out["time"]["constants"]["hbm_gbps"] == 123
    assert out["time"]["fit"]["frame_ms"] == pytest.approx(timing.FRAME_MS / 0.569)


def test_realtime_streams_is_the_largest_level_within_a_frame(fish):
    inp = inputs_for(fish, tp=2, ep=True)
    k = replace(K, launch_us=5.0, hbm_gbps=1.0)  # slow enough that each path runs out below 1024
    for graph in timing.GRAPHS:
        n = timing.realtime_streams(inp, graph, k, WL)
        assert 1 <= n < 1024, (graph, n)
        assert timing.frame_time(inp, n, graph, k, WL)["ms_per_frame"] <= timing.FRAME_MS
        assert timing.frame_time(inp, n + 1, graph, k, WL)["ms_per_frame"] > timing.FRAME_MS
    assert timing.realtime_streams(inp, "eager", replace(K, launch_us=1e3), WL) == 0


@pytest.mark.parametrize("option,value,expect", [
    ("--graph", "cuda", "--graph"), ("--concurrency", "1,x", "--concurrency"), ("--concurrency", "0", "between"),
    ("--card-hbm-gbps", "0", "--card-hbm-gbps"), ("--launch-us", "nan", "--launch-us"),
])
def test_bad_time_options_are_one_line(fish, option, value, expect):
    rc, _, err = run_plan(fish, "--card", "910b1", "--time", option, value)
    assert rc == 2 and expect in err and len(err.strip().splitlines()) == 1, err


def test_calibrate_fits_on_the_cards_frame_time_and_prints_measured_against_modelled(fish, tmp_path):
    step = 120.0
    report = {"bench": [{"max_concurrency": 1, "audio_throughput": 0.3}, {"max_concurrency": 8,
                                                                          "audio_throughput": 1.0}],
              "frame_time": {"steps": 24, "step_ms": {"p50": step, "p90": 130.0},
                             "components_ms": {"backbone": 50.0, "tower": 30.0, "sampler": 5.0, "other": 2.0,
                                               "outside_forward": 33.0}}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    rc, out, err = run_plan(fish, "--card", "910b1", "--tp", "2", "--ep", "--time", "--json", "-q",
                            "--calibrate", str(path), "--concurrency", "1,8")
    assert rc in (0, 1), err
    t = out["time"]
    launches = sum(row[0] for row in launch_table.LAUNCHES["fused"].values())
    assert t["fit"]["frame_ms"] == step  # the profiled step, not bench's c1 (46.4 / 0.3 = 155 ms)
    assert t["constants"]["launch_us"] == pytest.approx(1e3 * step / launches)
    eager8 = next(lv for lv in t["levels"] if lv["graph"] == "eager" and lv["concurrency"] == 8)
    assert eager8["measured_audio_s_per_s"] == 1.0
    assert t["calibration"]["modelled"]["step"] == pytest.approx(step)
    rc, text, _ = run_plan(fish, "--card", "910b1", "--tp", "2", "--ep", "--time", "-q", "--calibrate", str(path))
    assert "measured against modelled" in text and "outside_forward" in text and "120.0" in text


def test_launch_table_from_engine_summaries_sums_the_runner_and_model_state():
    """The e2e tier compares the engine's count with the table through this conversion."""
    def summary(scale):
        return {"components": {"backbone: MoE": {"launches": 7 * scale, "views": 3}, "runner": {"launches": 5 * scale},
                               "model state": {"launches": 2 * scale}, "sampler": {"launches": scale}}}
    table = launch_table.from_summaries({"fused": {1: summary(1), 64: summary(2)}})
    assert table == {"fused": {"backbone: MoE": (7, 14), "sampler": (1, 2), "outside the forward": (7, 14)}}
    # the shipped table's rows are the engine's component names (benchmarks/dispatch.py's)
    from support.dispatch import OUTSIDE_FORWARD, TOWER_AND_SAMPLER

    names = set(launch_table.LAUNCHES["fused"])
    assert set(TOWER_AND_SAMPLER) <= names and not set(OUTSIDE_FORWARD) & names
    assert set(launch_table.LAUNCHES["eager"]) == names


def test_zero_launch_cost_option_leaves_no_host_dispatch_in_the_json(fish):
    rc, out, err = run_plan(fish, "--card", "910b1", "--tp", "2", "--ep", "--time", "--json", "-q",
                            "--launch-us", "0", "--replay-us", "0")
    assert rc in (0, 1), err
    for lv in out["time"]["levels"]:
        assert lv["components_ms"]["host_dispatch"] == 0
        assert lv["ms_per_frame"] == pytest.approx(sum(lv["components_ms"][t] for t in timing.DEVICE_TERMS))
    rc, out, _ = run_plan(fish, "--card", "910b1", "--tp", "2", "--ep", "--time", "--json", "-q", "--launch-us", "1")
    assert all(lv["components_ms"]["host_dispatch"] > 0 for lv in out["time"]["levels"])  # the control


def test_every_named_card_has_speed_figures_with_their_sources():
    from drama3_patches.tools.plan.cards import CARDS, speed

    for card in CARDS.values():
        s = speed(card)
        assert s is not None and s.sources and all(isinstance(x, str) and x for x in s.sources), card.name
        assert s.hbm_gbps > 0 and s.bf16_tflops > 0 and s.fp32_tflops > 0 and s.link_gbps > 0
    assert speed(lookup(None, 48.0)) is None  # a custom card: the options must give them


def test_a_custom_card_without_speed_figures_is_one_line(fish):
    rc, _, err = run_plan(fish, "--card-gib", "48", "--time", "-q")
    assert rc == 2 and "--card-hbm-gbps" in err and len(err.strip().splitlines()) == 1, err


def test_a_custom_card_with_its_bandwidths_given_is_timed(fish):
    rc, out, err = run_plan(fish, "--card-gib", "48", "--time", "-q", "--json", "--card-hbm-gbps", "500",
                            "--link-gbps", "20", "--launch-us", "10")
    assert rc in (0, 1), err
    k = out["time"]["constants"]
    assert (k["hbm_gbps"], k["link_gbps"], k["bf16_tflops"]) == (500, 20, None)  # no throughput: bytes only
    rc, text, err = run_plan(fish, "--card-gib", "48", "--time", "-q", "--card-hbm-gbps", "500", "--link-gbps", "20")
    assert rc in (0, 1) and "bf16 not given TFLOPS" in text, err


def test_calibrate_on_a_compiled_run_fits_and_compares_the_piecewise_path(fish, tmp_path):
    report = {"stage0": {"compiled": True}, "bench": [{"max_concurrency": 1, "audio_throughput": 1.0}],
              "frame_time": {"step_ms": {"p50": 30.0}}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    rc, out, err = run_plan(fish, "--card", "910b1", "--time", "--json", "-q", "--calibrate", str(path))
    assert rc in (0, 1), err
    t = out["time"]
    L = T["num_hidden_layers"]
    b1 = {name: row[0] for name, row in launch_table.LAUNCHES["fused"].items()}
    launches = 2 * L + sum(b1[c] for c in launch_table.TOWER + launch_table.GLUE) + b1["outside the forward"]
    assert t["fit"]["graph"] == "piecewise"
    assert t["constants"]["launch_us"] == pytest.approx(1e3 * 30.0 / (launches + L + 1))
    compared = [(lv["graph"], lv["concurrency"]) for lv in t["levels"] if "measured_audio_s_per_s" in lv]
    assert compared == [("piecewise", 1)]
