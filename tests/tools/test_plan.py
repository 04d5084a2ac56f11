"""`drama3-patches plan` on small real checkpoints that these tests write: Drama 3's published
fish_omni format (FishOmniConfig config.json, Qwen3.5-MoE names, codebook tower, codec.pth) and the
Qwen3-Next layout of other MoE checkpoints.

Expected figures are computed here from the writer's tensor list, summed by the role the writer
gives each tensor, and from the model's formulas; never by summing what the planner summed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import defaultdict

import pytest

from drama3_patches.tools.plan import model as planner
from drama3_patches.tools.plan.cards import GIB, lookup
from drama3_patches.tools import plan as plan_cmd
from drama3_patches.tools.tiny_model import (CODEC_SPECS, DRAMA3_CFG, FISH_CFG, fish_tensor_specs, write_fish_checkpoint,
                                             write_safetensors)
from support.checkpoints import CFG, STANDIN_CFG, tensor_specs, write_checkpoint
from support.plan_cli import plan_here
from support.subproc import run_cli


def expected(cfg, tp, ep):
    """Per-card figures from the model's formulas."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    L = cfg["num_hidden_layers"]
    n_full = L // cfg["full_attention_interval"]
    n_lin = L - n_full
    nh, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    E, I, SI = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    kv_rank = max(1, kv // tp)
    # Sharded by TP: embeddings, projections, shared expert. Replicated: 1-D tensors and routers.
    sharded = 2 * (2 * V * H)
    sharded += n_full * 2 * (nh * hd * 2 * H + nh * hd * H)
    kv_proj = n_full * 2 * (2 * kv * hd * H) * kv_rank / kv
    sharded += n_lin * 2 * ((2 * nk * dk + 2 * nv * dv) * H + 2 * nv * H + (2 * nk * dk + nv * dv) * K + H * nv * dv)
    sharded += L * 2 * 3 * SI * H
    replicated = 2 * H + L * 2 * 2 * H + n_full * 2 * 2 * hd + n_lin * (4 * nv + 2 * nv + 4 * dv)
    replicated += L * 2 * (E * H + H)
    dense = sharded / tp + kv_proj + replicated
    scales = 2 * math.ceil(I / 128) * math.ceil(H / 128) + math.ceil(H / 128) * math.ceil(I / 128)
    frac = math.ceil(E / tp) / E if ep else 1 / tp
    stored = L * E * (3 * I * H + 4 * scales) * frac
    bf16 = L * E * 3 * I * H * 2 * frac
    layer_stored = E * (3 * I * H + 4 * scales) * frac
    gate_up = E * 2 * I * H * 2 * frac
    kv_tok = n_full * 2 * kv_rank * hd * 2
    state = n_lin * ((2 * nk * dk + nv * dv) // tp * (K - 1) + nv // tp * dv * dk) * 2
    return dict(dense=dense, experts_stored=stored, experts_bf16=bf16, resident=dense + bf16,
                load_peak=dense + bf16, load_peak_unpatched=dense + bf16 + layer_stored + gate_up,
                kv_per_token=kv_tok, state_per_seq=state)


def plan_json(ckpt, *args):
    r = run_cli("plan", str(ckpt), "--json", *args, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)




def fish_json(ckpt, *args):
    rc, out, _ = plan_here(ckpt, "--json", "-q", *args)
    assert rc in (0, 1)
    return rc, out


def _cli(*args):
    return run_cli("plan", *args, timeout=120)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "one"
    write_checkpoint(d)
    return d


@pytest.mark.parametrize("tp,ep", [(1, False), (2, False), (2, True), (4, True)])
def test_figures_match_the_formulas(ckpt, tp, ep):
    args = ["--card", "910b1", "--tp", str(tp), "--max-num-seqs", "8", "--max-model-len", "1024"]
    _, out = plan_json(ckpt, *args, *(["--ep"] if ep else []))
    exp = expected(CFG, tp, ep)
    for key, value in exp.items():
        assert out["figures"][key] == pytest.approx(value, rel=1e-12), key
    f = out["figures"]
    assert f["cache_needed"] == 8 * (1024 * exp["kv_per_token"] + exp["state_per_seq"])
    assert f["budget"] == pytest.approx(0.9 * 64 * GIB)
    assert f["left_for_cache"] == pytest.approx(0.9 * 64 * GIB - exp["resident"] - 2 * GIB)


def test_tp1_too_small_card_says_no_and_finds_tp2(ckpt):
    e1, e2 = expected(CFG, 1, False), expected(CFG, 2, True)
    # A card whose budget sits between the TP2 and TP1 load peaks.
    card_gib = (e1["load_peak"] + e2["load_peak"]) / 2 / 0.9 / GIB
    args = ["--card-gib", repr(card_gib), "--reserve-gib", "0", "--max-num-seqs", "1", "--max-model-len", "16"]
    rc, out = plan_json(ckpt, *args)
    assert rc == 1 and out["fits"] is False
    assert "load peak" in out["problems"][0]
    assert out["smallest_fit"] == [{"tp": 2, "ep": False}, {"tp": 2, "ep": True}]
    r = _cli(str(ckpt), *args, "--tp", "2", "--ep")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verdict: FITS" in r.stdout
    assert "smallest that fits: TP 2 (without EP or with EP)" in r.stdout


def test_block_constraint_requires_ep(ckpt):
    # moe_intermediate_size 256 / TP 4 = 64 rows: not a multiple of the 128 FP8 block.
    rc, out = plan_json(ckpt, "--card", "910b1", "--tp", "4")
    assert rc == 1
    assert any("not a multiple of the FP8 block 128: use --ep" in p for p in out["problems"])
    rc, out = plan_json(ckpt, "--card", "910b1", "--tp", "4", "--ep")
    assert rc == 0 and out["fits"]


def test_cache_shortfall_names_the_max_num_seqs_that_fits(ckpt):
    e = expected(CFG, 1, False)
    per_seq = 4096 * e["kv_per_token"] + e["state_per_seq"]
    card_gib = (e["resident"] + 10.5 * per_seq) / GIB  # U=1, no reserve: room for 10 sequences
    rc, out = plan_json(ckpt, "--card-gib", repr(card_gib), "--gpu-memory-utilization", "1", "--reserve-gib", "0",
                        "--max-num-seqs", "64", "--max-model-len", "4096")
    assert rc == 1
    assert out["figures"]["max_num_seqs_that_fit"] == 10
    assert "(max_num_seqs 10 would fit)" in out["problems"][0]


def test_mxfp8_card_keeps_experts_fp8(ckpt):
    _, out = plan_json(ckpt, "--card", "950pr")
    e = expected(CFG, 1, False)
    f = out["figures"]
    weight_elems = CFG["num_hidden_layers"] * CFG["num_experts"] * 3 * 256 * 256
    assert f["experts_resident"] == pytest.approx(weight_elems + weight_elems / 32)
    assert f["resident"] == pytest.approx(e["dense"] + weight_elems * (1 + 1 / 32))
    _, out = plan_json(ckpt, "--card-gib", "64", "--mxfp8")
    assert out["figures"]["experts_resident"] == f["experts_resident"]


def test_sharded_index_gives_the_same_figures(tmp_path, ckpt):
    write_checkpoint(tmp_path / "sharded", shards=3)
    _, one = plan_json(ckpt, "--card", "910b4", "--tp", "2", "--ep")
    _, three = plan_json(tmp_path / "sharded", "--card", "910b4", "--tp", "2", "--ep")
    assert len(three["files"]) == 3
    assert three["figures"] == one["figures"]


def test_only_shapes_and_dtypes_are_read(tmp_path, monkeypatch):
    """Through safetensors' lazy reader: keys and slices' shape/dtype, never a tensor."""
    import safetensors

    write_checkpoint(tmp_path / "c", shards=2)
    used = defaultdict(int)
    real = safetensors.safe_open

    class Spy:
        def __init__(self, obj):
            self.obj = obj

        def __getattr__(self, name):
            used[name] += 1
            value = getattr(self.obj, name)
            return (lambda *a, **k: _wrap(value(*a, **k))) if callable(value) else value

        def __enter__(self):
            self.obj.__enter__()
            return self

        def __exit__(self, *exc):
            return self.obj.__exit__(*exc)

        def __getitem__(self, key):
            raise AssertionError("tensor data sliced")

    def _wrap(v):
        return Spy(v) if type(v).__name__ == "PySafeSlice" else v

    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: Spy(real(*a, **k)))
    ck = planner.load_checkpoint(str(tmp_path / "c"))
    assert len(ck.tensors) == len(tensor_specs())
    assert set(used) == {"keys", "get_slice", "get_shape", "get_dtype"}
    assert used["get_slice"] == used["get_shape"] == used["get_dtype"] == len(tensor_specs())


def test_text_report(ckpt):
    r = _cli(str(ckpt), "--card", "910b1", "--tp", "2", "--ep", "--max-num-seqs", "4", "--max-model-len", "512")
    assert r.returncode == 0, r.stderr
    e = expected(CFG, 2, True)
    lines = r.stdout.splitlines()
    row = next(line for line in lines if "routed experts after bfloat16 expansion" in line)
    assert e["experts_bf16"] < GIB and row.split()[-2:] == [f"{e['experts_bf16'] / 2 ** 20:.2f}", "MiB"]
    row = next(line for line in lines if "stage budget" in line)
    assert row.split()[-2:] == [f"{0.9 * 64:.2f}", "GiB"]
    assert any(line.startswith("model: 4 layers (2 full attention, 2 linear attention), 8 routed experts")
               for line in lines)
    assert "card: 910B1, 64 GiB, no MXFP8; TP 2, EP on" in r.stdout
    assert f"KV {e['kv_per_token']} B/token, linear-attention state {e['state_per_seq']} B/sequence" in r.stdout


def test_drama3_scale_tp1_on_910b1_does_not_fit(tmp_path):
    """A checkpoint of real size (sparse files: headers written, data never touched)."""
    cfg = STANDIN_CFG
    write_checkpoint(tmp_path / "big", cfg, shards=4, sparse=True)
    if sum(p.stat().st_blocks for p in (tmp_path / "big").glob("*.safetensors")) * 512 > 1 << 30:
        pytest.skip("this file system does not keep sparse files sparse")
    rc, out = plan_json(tmp_path / "big", "--card", "910b1", "--tp", "1")
    e1 = expected(cfg, 1, False)
    assert rc == 1
    assert out["figures"]["load_peak"] == pytest.approx(e1["load_peak"])
    assert out["figures"]["load_peak"] > 0.9 * 64 * GIB
    assert out["smallest_fit"][0]["tp"] == 2


@pytest.mark.parametrize("case", ["no_dir", "no_config", "bad_config", "no_safetensors", "missing_shard",
                                  "truncated", "not_safetensors", "unknown_card", "no_text_config"])
def test_bad_input_gets_one_clear_line(tmp_path, ckpt, case):
    d = tmp_path / "c"
    args = ["--card", "910b1"]
    if case == "no_dir":
        expect = "not a directory"
    elif case == "no_config":
        d.mkdir()
        write_safetensors(d / "model.safetensors", tensor_specs()[:3])
        expect = "no config.json"
    elif case == "bad_config":
        write_checkpoint(d)
        (d / "config.json").write_text("{nope")
        expect = "config.json: not valid JSON"
    elif case == "no_safetensors":
        d.mkdir()
        (d / "config.json").write_text(json.dumps(CFG))
        expect = "no *.safetensors files"
    elif case == "missing_shard":
        write_checkpoint(d, shards=3)
        (d / "model-00002-of-00003.safetensors").unlink()
        expect = "model.safetensors.index.json names shard model-00002-of-00003.safetensors"
    elif case == "truncated":
        write_checkpoint(d)
        f = d / "model.safetensors"
        os.truncate(f, f.stat().st_size - 1)
        expect = "model.safetensors: not a readable safetensors file: "
    elif case == "not_safetensors":
        d.mkdir()
        (d / "config.json").write_text(json.dumps(CFG))
        (d / "model.safetensors").write_bytes(b"PK\x03\x04" + b"\0" * 100)
        expect = "model.safetensors: not a readable safetensors file: "
    elif case == "unknown_card":
        d = ckpt
        args = ["--card", "a100"]
        expect = "unknown card 'a100'; known: 910b1, 910b2, 910b3, 910b4, 950pr, 950dt"
    else:
        write_checkpoint(d)
        (d / "config.json").write_text(json.dumps({"model_type": "x", "audio": {"sample_rate": 44100}}))
        expect = "no language-model section"
    r = _cli(str(d), *args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("drama3-patches plan: ") and expect in lines[0], r.stderr


def _edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _deep(n: int) -> str:
    return '{"a": ' + "[" * n + "]" * n + "}"


BAD_CONFIG = {
    # case: (fish_omni checkpoint?, edit of config.json or the file's new text, expected line's tail)
    "layers_string": (False, lambda c: c.update(num_hidden_layers="forty"),
                      "config.json: num_hidden_layers is a string ('forty'); it must be a whole number"),
    "zero_heads": (False, lambda c: c.update(num_attention_heads=0),
                   "config.json: num_attention_heads is 0; it must be at least 1"),
    "heads_list": (False, lambda c: c.update(num_key_value_heads=[2]),
                   "config.json: num_key_value_heads is a list; it must be a whole number"),
    "block_string": (False, lambda c: c.update(quantization_config={"weight_block_size": "128x128"}),
                     "quantization_config.weight_block_size is a string ('128x128'); it must be [rows, columns]"),
    "quant_list": (False, lambda c: c.update(quantization_config=[1]),
                   "config.json: quantization_config is a list; it must be a mapping (key: value)"),
    "deep": (False, _deep(100_000), "config.json: nested too deep to read"),
    "nested_40": (False, _deep(40), "config.json: nested more than 32 levels deep"),
    "text_config_list": (True, lambda c: c.update(text_config=[1, 2]),
                         "config.json: text_config is a list; it must be a mapping (key: value)"),
    "decoder_zero": (True, lambda c: c["audio_decoder_config"].update(num_codebooks=0),
                     "config.json (audio_decoder_config): num_codebooks is 0; it must be at least 1"),
    "id_string": (True, lambda c: c.update(eos_token_id="eos"),
                  "config.json: eos_token_id is a string ('eos'); it must be a whole number"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIG))
def test_wrong_types_and_zeros_in_config_are_one_line(tmp_path, case):
    fish_ckpt, edit, expect = BAD_CONFIG[case]
    d = tmp_path / "c"
    write_fish_checkpoint(d, codec=False) if fish_ckpt else write_checkpoint(d)
    if isinstance(edit, str):
        (d / "config.json").write_text(edit)
    else:
        _edit_json(d / "config.json", edit)
    r = _cli(str(d), "--card", "910b1", "-q")
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("drama3-patches plan: ") and expect in lines[0], r.stderr


def test_oversized_config_and_a_bad_index_are_one_line(tmp_path):
    d = tmp_path / "big"
    write_checkpoint(d)
    with open(d / "config.json", "r+b") as fh:
        fh.truncate(17 * 1024 * 1024)  # sparse: refused by its size, never read
    r = _cli(str(d), "--card", "910b1", "-q")
    assert r.returncode == 2 and "config.json: 17.0 MiB, over the 16.0 MiB limit for a JSON file" in r.stderr
    d = tmp_path / "index"
    write_checkpoint(d, shards=2)
    index = d / "model.safetensors.index.json"
    _edit_json(index, lambda i: i["weight_map"].update({next(iter(i["weight_map"])): ["a", "b"]}))
    r = _cli(str(d), "--card", "910b1", "-q")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "model.safetensors.index.json: weight_map[" in r.stderr and "is a list; it must be a shard file name" in r.stderr
    _edit_json(index, lambda i: i["weight_map"].update({next(iter(i["weight_map"])): "../../etc/x.safetensors"}))
    r = _cli(str(d), "--card", "910b1", "-q")
    assert r.returncode == 2 and "is '../../etc/x.safetensors', outside the checkpoint folder" in r.stderr


BAD_DEPLOY = {
    "top_list": ("- 1\n- 2\n", "--deploy {}: the top level is a list; it must be a mapping (key: value)"),
    "stages_mapping": ("stages:\n  a: 1\n", "--deploy {}: stages is a mapping; it must be a list of stages"),
    "stage_list": ("stages:\n  - [1]\n", "--deploy {}: stages[0] is a list; it must be a mapping (key: value)"),
    "tp_string": ("stages:\n  - stage_id: 0\n    tensor_parallel_size: two\n",
                  "--deploy {}: stage 0 tensor_parallel_size is a string ('two'); it must be a whole number"),
    "tp_zero": ("stages:\n  - stage_id: 0\n    tensor_parallel_size: 0\n",
                "--deploy {}: stage 0 tensor_parallel_size is 0; it must be at least 1"),
    "share_string": ("stages:\n  - stage_id: 0\n    gpu_memory_utilization: '0.9'\n",
                     "--deploy {}: stage 0 gpu_memory_utilization is a string ('0.9'); it must be a number"),
    "connector_list": ("stages:\n  - stage_id: 0\nconnectors:\n  c: [1]\n",
                       "--deploy {}: connectors.c is a list; it must be a mapping (key: value)"),
    "deep": ("[" * 100_000 + "]" * 100_000, "{}: nested too deep to read"),
    "ep_filter_int": ("stages:\n  - stage_id: 0\n    enable_ep_weight_filter: 1\n",
                      "--deploy {}: stage 0 enable_ep_weight_filter is int (1); it must be true or false"),
    "dac_dtype": ("stages:\n  - stage_id: 0\nconnectors:\n  c:\n    extra:\n      fish_speech_dac_dtype: int8\n",
                  "--deploy {}: connectors.c.extra.fish_speech_dac_dtype is 'int8', not a dtype the DAC decoder takes"),
    "no_stage0": ("stages:\n  - stage_id: 1\n", "--deploy {}: no stage 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_DEPLOY))
def test_wrong_types_in_a_deploy_file_are_one_line(tmp_path, ckpt, case):
    text, expect = BAD_DEPLOY[case]
    f = tmp_path / "deploy.yaml"
    f.write_text(text)
    r = _cli(str(ckpt), "--card", "910b1", "--deploy", str(f), "-q")
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("drama3-patches plan: ") and expect.format(f) in lines[0], r.stderr


@pytest.mark.parametrize("option,value,expect", [
    ("--card-gib", "0", "--card-gib must be a finite number of GiB above 0, got 0"),
    ("--card-gib", "inf", "--card-gib must be a finite number of GiB above 0, got inf"),
    ("--reserve-gib", "nan", "--reserve-gib must be a finite number of GiB at least 0, got nan"),
    ("--reserve-gib", "-3", "--reserve-gib must be a finite number of GiB at least 0, got -3"),
])
def test_numeric_options_out_of_range_are_one_line(ckpt, option, value, expect):
    r = _cli(str(ckpt), "--card", "910b1", option, value, "-q")
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"drama3-patches plan: {expect}\n")


def test_nested_config_sections(tmp_path, ckpt):
    """A non-Drama omni config.json: the language model's fields under text_config, another tower beside it."""
    d = tmp_path / "omni"
    write_checkpoint(d)
    tower = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2}
    (d / "config.json").write_text(json.dumps({"model_type": "some_omni", "audio_decoder_config": tower,
                                               "text_config": CFG}))
    _, top = plan_json(ckpt, "--card", "910b1")
    _, nested = plan_json(d, "--card", "910b1")
    assert nested["config_section"] == "text_config"
    assert nested["figures"] == top["figures"]
    _, other = plan_json(d, "--card", "910b1", "--config-section", "audio_decoder_config")
    assert other["config_section"] == "audio_decoder_config"
    assert other["figures"]["kv_per_token"] == 2 * 2 * 2 * (64 // 2) * 2  # 2 full layers, K+V, 2 heads x 32
    r = _cli(str(d), "--card", "910b1", "--config-section", "vocoder")
    assert r.returncode == 2 and r.stderr.strip() == "drama3-patches plan: config.json: no section 'vocoder'"


def test_safetensors_library_checkpoint_reads_the_same(tmp_path, ckpt):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}
    d = tmp_path / "lib"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CFG))
    st.save_file({n: torch.zeros(s, dtype=dtypes[t]) for n, t, s in tensor_specs()}, str(d / "model.safetensors"))
    _, a = plan_json(ckpt, "--card", "910b1", "--tp", "2", "--ep")
    _, b = plan_json(d, "--card", "910b1", "--tp", "2", "--ep")
    assert a["figures"] == b["figures"]


def test_run_in_process_through_register(ckpt, capsys):
    parser = argparse.ArgumentParser()
    plan_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["plan", str(ckpt), "--card", "910B3", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["card"] == {"name": "910B3", "memory_gib": 64.0, "mxfp8": False}
    assert lookup("910b4").memory_gib == 32


# ---------------------------------------------------------------------------------------------
# Drama 3 in its published format (fish_omni)
# ---------------------------------------------------------------------------------------------

BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1}


def fish_expected(cfg, tp, ep, seqs, mlen, batched=4096, ssm_bytes=None, dac_bytes=4, split=True):
    """Per-card figures of a fish_omni checkpoint from the writer's tensor list, by role.
    ``split``: the tower's attention heads per rank at TP > 1 (fish-omni-tower-tp-split)."""
    t, a = cfg["text_config"], cfg["audio_decoder_config"]
    by = defaultdict(int)
    for _, dt, shape, role in fish_tensor_specs(cfg):
        by[role] += math.prod(shape) * BYTES[dt]
    H, E, I = t["hidden_size"], t["num_experts"], t["moe_intermediate_size"]
    kv, hd = t["num_key_value_heads"], t["head_dim"]
    kv_rank = max(1, kv // tp)
    dense = by["shard"] / tp + by["kv"] * kv_rank / kv + by["rep"]
    rows = 1 + cfg["semantic_end_token_id"] - cfg["semantic_start_token_id"]  # eos + codes 1..end
    head = rows * H * 2
    tower = by["tower"] + by["tower_eh"] / 2
    hq, hk, dh = a["n_head"], a["n_local_heads"], a["head_dim"]
    tower_kv = max(1, hk // tp) if split and tp > 1 else hk
    if split and tp > 1:
        n_layers = a["shared_enrichment_layers"] + a["num_codebooks"] - 1
        qkv = n_layers * (2 * hq + 2 * hk) * dh * a["dim"] * 2
        wo = n_layers * a["dim"] * hq * dh * 2
        tower -= qkv - n_layers * (2 * hq // tp + 2 * tower_kv) * dh * a["dim"] * 2 + wo * (1 - 1 / tp)
    codec = defaultdict(int)
    for _, shape, role in CODEC_SPECS:
        codec[role] += math.prod(shape)
    dac_encoder = (codec["enc"] + codec["enc_g"] + codec["shared"]) * 4
    dac = (codec["shared"] + codec["dec"]) * dac_bytes
    C = a["num_codebooks"]
    buffers = (seqs + 1) * mlen * C * 2 + batched * H * 2
    frac = math.ceil(E / tp) / E if ep else 1 / tp
    stored = (by["expert_w"] + by["expert_scale"]) * frac
    bf16 = by["expert_w"] * 2 * frac
    resident = dense + head + tower + dac_encoder + buffers + bf16
    b = 128
    scales = 2 * math.ceil(I / b) * math.ceil(H / b) + math.ceil(H / b) * math.ceil(I / b)
    layer_stored = E * (3 * I * H + 4 * scales) * frac
    gate_up = E * 2 * I * H * 2 * frac
    n_full = t["layer_types"].count("full_attention")
    n_lin = len(t["layer_types"]) - n_full
    n_tower = a["shared_enrichment_layers"] + C - 1
    kv_tower = n_tower * 2 * tower_kv * a["head_dim"] * 2
    kv_tok = n_full * 2 * kv_rank * hd * 2 + kv_tower
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv, K = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_conv_kernel_dim"]
    state = n_lin * ((2 * nk * dk + nv * dv) // tp * (K - 1) * 2 + nv // tp * dv * dk * (ssm_bytes or 2))
    return dict(dense=dense, head=head, tower=tower, dac_encoder=dac_encoder, model_buffers=buffers,
                experts_stored=stored, experts_bf16=bf16, resident=resident, load_peak=resident,
                load_peak_unpatched=resident + layer_stored + gate_up, kv_per_token=kv_tok,
                kv_per_token_tower=kv_tower, state_per_seq=state, cache_needed=seqs * (mlen * kv_tok + state),
                dac_weights=dac)


@pytest.fixture(scope="module")
def fish(tmp_path_factory):
    d = tmp_path_factory.mktemp("fish") / "drama3"
    write_fish_checkpoint(d)
    return d


@pytest.mark.parametrize("tp,ep", [(1, False), (2, False), (2, True)])
def test_fish_omni_figures_are_exact(fish, tp, ep):
    args = ["--card", "910b1", "--tp", str(tp), "--max-num-seqs", "8", "--max-model-len", "1024"]
    rc, out = fish_json(fish, *args, *(["--ep"] if ep else []))
    assert out["model_type"] == "fish_omni" and out["config_section"] == "text_config"
    exp = fish_expected(FISH_CFG, tp, ep, 8, 1024)
    for key, value in exp.items():
        assert out["figures"][key] == pytest.approx(value, rel=1e-12), key
    assert out["figures"]["dac_budget"] == pytest.approx(0.1 * 64 * GIB)
    assert out["codec_tensors"] == len(CODEC_SPECS)
    assert out["tensors"] == len(fish_tensor_specs())
    tp_note = [n for n in out["notes"] if "refuses tensor_parallel_size != 1" in n]
    assert bool(tp_note) == (tp > 1)


def test_fish_omni_config_class_and_json_read_the_same(fish):
    """FishOmniConfig where vLLM-Omni 0.32.0rc1 is installed, the same keys as plain JSON elsewhere."""
    from drama3_patches.versions import installed_version

    card = lookup("910b1")
    json_ck = planner.load_checkpoint(str(fish), use_class=False)
    assert json_ck.config_source == "config.json read as JSON (fish_omni format)"
    class_ck = planner.load_checkpoint(str(fish))
    if installed_version("vllm-omni") == "0.32.0rc1":
        assert class_ck.config_source == "FishOmniConfig (vllm-omni 0.32.0rc1)"
    else:
        assert class_ck.config_source == json_ck.config_source
    assert planner.model_shape(class_ck) == planner.model_shape(json_ck)
    opts = planner.Options(card=card, max_num_seqs=4, max_model_len=256)
    assert planner.make_plan(class_ck, opts).figures == planner.make_plan(json_ck, opts).figures


def test_fish_omni_dac_stage_on_its_card(fish, tmp_path):
    _, f32 = fish_json(fish, "--card", "910b1", "-q")
    _, f16 = fish_json(fish, "--card", "910b1", "--dac-dtype", "float16", "-q")
    assert f16["figures"]["dac_weights"] * 2 == f32["figures"]["dac_weights"] == fish_expected(
        FISH_CFG, 1, False, 64, 16384)["dac_weights"]
    # Stage 0 and the DAC stage share a card: their shares may not pass 1.
    rc, out = fish_json(fish, "--card", "910b1", "--gpu-memory-utilization", "0.9", "--dac-gpu-memory-utilization",
                        "0.12", "-q")
    assert rc == 1 and out["problems"] == ["stage 0 (0.9) and the DAC stage (0.12) ask for 1.02 of the card they share"]
    # A card too small for the DAC decoder's weights in its share.
    dac_gib = f32["figures"]["dac_weights"] / GIB
    rc, out = fish_json(fish, "--card-gib", repr(dac_gib / 0.05 * 0.9), "--dac-gpu-memory-utilization", "0.05",
                        "--gpu-memory-utilization", "0.5", "--reserve-gib", "0", "--max-num-seqs", "1",
                        "--max-model-len", "16", "-q")
    assert any(p.startswith("DAC stage weights") for p in out["problems"]), out["problems"]
    # Without codec.pth the plan says what it left out.
    d = tmp_path / "nocodec"
    write_fish_checkpoint(d, codec=False)
    _, text, _ = plan_here(d, "--card", "910b1", "-q")
    assert f"  note: no codec.pth in {d}: the DAC stage and stage 0's reference encoder are not counted" in text.splitlines()


def test_fish_omni_deploy_profile_settings(fish):
    _, out = fish_json(fish, "--card", "910b1", "--deploy", "910b-tp2-ep", "-q")
    assert (out["tp"], out["ep"], out["max_num_seqs"], out["max_model_len"]) == (2, True, 64, 8192)
    assert out["gpu_memory_utilization"] == 0.8 and out["mamba_ssm_cache_dtype"] == "float32"
    exp = fish_expected(FISH_CFG, 2, True, 64, 8192, ssm_bytes=4)
    assert out["figures"]["state_per_seq"] == exp["state_per_seq"]
    assert out["figures"]["dac_budget"] == pytest.approx(0.12 * 64 * GIB)
    _, over = fish_json(fish, "--card", "910b1", "--deploy", "910b-tp2-ep", "--max-model-len", "512", "-q")
    assert over["max_model_len"] == 512 and over["tp"] == 2  # an option wins over the profile
    rc, _, err = plan_here(fish, "--card", "910b1", "--deploy", "nope")
    assert rc == 2 and err == "drama3-patches plan: --deploy nope: neither a profile (910b-tp2-ep, 910b-tp2-ep-graph, mxfp8-1card) nor a file\n"


def test_fish_omni_unexpected_key_is_one_line(tmp_path):
    d = tmp_path / "odd"
    write_fish_checkpoint(d, codec=False)
    write_safetensors(d / "extra.safetensors", [("vision.proj.weight", "BF16", (4, 4))])
    rc, _, err = plan_here(d, "--card", "910b1", "-q")
    assert rc == 2
    assert err.strip() == ("drama3-patches plan: extra.safetensors: tensor 'vision.proj.weight' is not a "
                                "fish_omni weight (the published model refuses unexpected checkpoint keys)")


def test_progress_goes_to_stderr_and_quiet_silences_it(tmp_path):
    d = tmp_path / "sharded"
    write_fish_checkpoint(d, shards=2)
    r = _cli(str(d), "--card", "910b1", "--json")
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)  # standard output stays the JSON document
    lines = r.stderr.splitlines()
    assert "drama3-patches plan: reading tensor shapes of model-00001-of-00002.safetensors (1/2)" in lines
    assert "drama3-patches plan: reading codec.pth (DAC codec) tensor shapes through torch.load(mmap=True)" in lines
    assert lines[-1].startswith(f"drama3-patches plan: read {len(fish_tensor_specs())} tensors from 2 files in ")
    r = _cli(str(d), "--card", "910b1", "--json", "--quiet")
    assert r.returncode == 0 and r.stderr == ""


@pytest.fixture(scope="module")
def drama3_size(tmp_path_factory):
    """The published class's shape at full size (sparse files: headers written, data never touched)."""
    d = tmp_path_factory.mktemp("drama3") / "published"
    write_fish_checkpoint(d, DRAMA3_CFG, shards=4, sparse=True)
    if sum(p.stat().st_blocks for p in d.glob("*.safetensors")) * 512 > 1 << 30:
        pytest.skip("this file system does not keep sparse files sparse")
    return d


def test_published_shape_tp1_on_910b1_is_refused(drama3_size):
    rc, out = fish_json(drama3_size, "--card", "910b1", "--tp", "1", "-q")
    e1 = fish_expected(DRAMA3_CFG, 1, False, 64, 16384)
    assert rc == 1 and out["fits"] is False
    assert out["figures"]["load_peak"] == pytest.approx(e1["load_peak"], rel=1e-12)
    assert out["figures"]["load_peak"] > 0.9 * 64 * GIB
    assert out["problems"][0].startswith("load peak ")


def test_published_shape_tp2_ep_fits_the_910b_profile(drama3_size):
    """TP2 + EP (the 910b-tp2-ep profile) holds the weights; with the published whole-head tower the
    cache for 64 full 8192-token sequences does not fit, and the plan names the max_num_seqs that
    does; with the tower split per rank (the default) it does."""
    rc, out = fish_json(drama3_size, "--card", "910b1", "--deploy", "910b-tp2-ep", "-q")
    e = fish_expected(DRAMA3_CFG, 2, True, 64, 8192, ssm_bytes=4)
    f = out["figures"]
    assert rc == 0 and out["fits"] and f["tower_split"] and f["tower_kv_heads"] == 1
    assert f["cache_needed"] == e["cache_needed"] and f["resident"] == pytest.approx(e["resident"], rel=1e-12)
    rc, out = fish_json(drama3_size, "--card", "910b1", "--deploy", "910b-tp2-ep", "--no-tower-split", "-q")
    e = fish_expected(DRAMA3_CFG, 2, True, 64, 8192, ssm_bytes=4, split=False)
    f = out["figures"]
    assert f["load_peak"] == pytest.approx(e["load_peak"], rel=1e-12) and f["load_peak"] < 0.8 * 64 * GIB
    assert f["cache_needed"] == e["cache_needed"]
    left = 0.8 * 64 * GIB - e["resident"] - 2 * GIB
    per_seq = 8192 * e["kv_per_token"] + e["state_per_seq"]
    assert rc == 1 and out["problems"] == [
        f"KV cache + linear-attention state for 64 x 8192 tokens needs {e['cache_needed'] / GIB:.2f} GiB, "
        f"{left / GIB:.2f} GiB left (max_num_seqs {int(left // per_seq)} would fit)"]
    rc, out = fish_json(drama3_size, "--card", "910b1", "--deploy", "910b-tp2-ep", "--max-model-len", "4096",
                        "--no-tower-split", "-q")
    assert rc == 0 and out["fits"], out["problems"]


def test_disk_read_per_rank_with_the_ep_weight_filter(fish):
    """Every rank reads every tensor; with EP and vLLM's weight filter (the 910b-tp2-ep profile sets
    it) the other rank's expert weights are skipped, their scales still read."""
    specs = fish_tensor_specs(FISH_CFG)
    total = sum(math.prod(shape) * BYTES[dt] for _, dt, shape, _ in specs)
    experts_w = sum(math.prod(shape) * BYTES[dt] for _, dt, shape, role in specs if role == "expert_w")
    _, out = fish_json(fish, "--card", "910b1", "--deploy", "910b-tp2-ep", "-q")
    assert out["figures"]["disk_read_filtered"] is True
    assert out["figures"]["disk_read_per_rank"] == total - experts_w / 2
    _, out = fish_json(fish, "--card", "910b1", "--deploy", "910b-tp2-ep", "--no-ep-weight-filter", "-q")
    assert out["figures"]["disk_read_per_rank"] == total and out["figures"]["disk_read_filtered"] is False
    _, out = fish_json(fish, "--card", "910b1", "--tp", "2", "--no-ep", "--ep-weight-filter", "-q")
    assert out["figures"]["disk_read_per_rank"] == total  # the filter needs expert parallel


def test_fish_omni_card_between_tp1_and_tp2_peaks_says_no_then_tp2_ep_fits(fish):
    e1, e2 = fish_expected(FISH_CFG, 1, False, 1, 16), fish_expected(FISH_CFG, 2, True, 1, 16)
    card_gib = (e1["load_peak"] + e2["load_peak"]) / 2 / 0.9 / GIB
    args = ["--card-gib", repr(card_gib), "--reserve-gib", "0", "--max-num-seqs", "1", "--max-model-len", "16"]
    rc, out = fish_json(fish, *args)
    assert rc == 1 and out["problems"][0].startswith("load peak ")
    assert out["smallest_fit"] == [{"tp": 2, "ep": False}, {"tp": 2, "ep": True}]
    rc, text, _ = plan_here(fish, *args, "--tp", "2", "--ep", "-q")
    assert rc == 0 and "verdict: FITS" in text and "smallest that fits: TP 2 (without EP or with EP)" in text


def _one_tower_name(suffix):
    return next(n for n, _, _, _ in fish_tensor_specs() if n.endswith(suffix))


@pytest.mark.parametrize("name,bad", [
    ("lm_head.weight", ()), ("lm_head.weight", (7,)), ("lm_head.weight", (0, 4)),
    (".attention.wqkv.weight", ()), (".attention.wqkv.weight", (12,)),
    ("tower_eh", ()), ("tower_eh", (8,)),
])
def test_a_weight_that_is_not_a_matrix_is_one_line(tmp_path, name, bad):
    """A 0-d, 1-d or empty tensor where plan divides by a matrix's rows is bad input (exit 2, one
    line naming the tensor and its shape), not the bug path (exit 70)."""
    specs = fish_tensor_specs()
    if name == "tower_eh":
        name = next(n for n, _, _, role in specs if role == "tower_eh")
    elif name.startswith("."):
        name = _one_tower_name(name)
    d = tmp_path / "bad"
    write_fish_checkpoint(d, codec=False)
    write_safetensors(d / "model.safetensors", [(n, t, bad if n == name else s) for n, t, s, _ in specs])
    rc, _, err = plan_here(d, "--card", "910b1", "-q")
    assert (rc, err) == (2, f"drama3-patches plan: model.safetensors: tensor {name!r} has shape {list(bad)}, "
                            "not a 2-d weight matrix\n")


@pytest.mark.parametrize("limit,expect", [
    ("MAX_CODEC_BYTES", r"codec\.pth: 0\.0 GiB, over the 0\.0 GiB limit for a codec file"),
    ("MAX_CODEC_PICKLE_BYTES", r"codec\.pth: its pickle is 0\.0 MiB, over the 0\.0 MiB limit for a state dict's "
                               r"names and shapes"),
])
def test_codec_file_and_its_pickle_are_bounded(tmp_path, monkeypatch, limit, expect):
    """codec.pth over the file limit, or whose pickle (which torch.load reads whole) is over the
    pickle limit, is one line and exit 2 before torch.load runs (limits lowered to 100 bytes)."""
    import re

    d = tmp_path / "fish"
    write_fish_checkpoint(d)
    monkeypatch.setattr(planner, limit, 100)
    loads = []
    monkeypatch.setattr("torch.load", lambda *a, **k: loads.append(a))
    rc, _, err = plan_here(d, "--card", "910b1", "-q")
    assert rc == 2 and re.fullmatch(f"drama3-patches plan: {expect}\n", err), err
    assert loads == []


def test_a_codec_file_that_is_not_an_archive_is_one_line(tmp_path):
    d = tmp_path / "fish"
    write_fish_checkpoint(d, codec=False)
    (d / "codec.pth").write_bytes(b"not a zip archive at all")
    rc, _, err = plan_here(d, "--card", "910b1", "-q")
    assert rc == 2 and err.startswith("drama3-patches plan: codec.pth: not a torch zip archive: "), err
    assert err.count("\n") == 1


def test_profile_settings_come_from_the_one_deploy_check():
    """deploy_settings of each built-in profile is check_deploy of its parsed YAML, and holds the
    values the profile's stage 0 and connectors give (whole numbers as int, the DAC dtype by name)."""
    import yaml

    from drama3_patches.tools.deploy_config.profiles import PROFILES, profile_text
    from drama3_patches.tools.plan.inputs import check_deploy

    for name in PROFILES:
        data = yaml.safe_load(profile_text(name))
        got = plan_cmd.deploy_settings(name)
        assert got == check_deploy(data, name)
        (s0,) = [s for s in data["stages"] if s.get("stage_id") == 0]
        assert got["tp"] == s0["tensor_parallel_size"] and type(got["tp"]) is int
        assert got.get("ep", False) == s0.get("enable_expert_parallel", False)
