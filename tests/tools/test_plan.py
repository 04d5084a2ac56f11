"""`drama3-patches plan` on small real checkpoints that these tests write.

Expected figures are computed here from the model's formulas (parameter
counts per role), not by summing what the planner summed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from drama3_patches.tools.plan import model as planner
from drama3_patches.tools.plan.cards import GIB, lookup
from drama3_patches.tools import plan as plan_cmd
from support.checkpoints import CFG, STANDIN_CFG, tensor_specs, write_checkpoint, write_safetensors

REPO = Path(__file__).resolve().parents[2]


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
    r = subprocess.run([sys.executable, "-m", "drama3_patches.tools", "plan", str(ckpt), "--json", *args],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "drama3_patches.tools", "plan", *args], capture_output=True,
                          text=True, env=_env(), timeout=120)


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


def test_only_headers_are_read(tmp_path, monkeypatch):
    header_bytes = write_checkpoint(tmp_path / "c", shards=2)
    data_bytes = sum(p.stat().st_size for p in (tmp_path / "c").glob("*.safetensors")) - header_bytes
    read = []
    real_open = open

    class Counting:
        def __init__(self, fh):
            self.fh = fh

        def read(self, n=-1):
            assert n >= 0, "a read to the end of a safetensors file"
            data = self.fh.read(n)
            read.append(len(data))
            return data

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    def counting_open(path, mode="r", *a, **k):
        fh = real_open(path, mode, *a, **k)
        return Counting(fh) if str(path).endswith(".safetensors") else fh

    monkeypatch.setattr(planner, "open", counting_open, raising=False)
    ck = planner.load_checkpoint(str(tmp_path / "c"))
    assert sum(read) == header_bytes == ck.header_bytes_read
    assert data_bytes > 50 * header_bytes


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
        expect = "model.safetensors: truncated: tensor"
    elif case == "not_safetensors":
        d.mkdir()
        (d / "config.json").write_text(json.dumps(CFG))
        (d / "model.safetensors").write_bytes(b"PK\x03\x04" + b"\0" * 100)
        expect = "does not fit a 104-byte file"
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


def test_nested_config_sections(tmp_path, ckpt):
    """An omni config.json: the language model's fields under text_config, another tower beside it."""
    d = tmp_path / "omni"
    write_checkpoint(d)
    tower = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2}
    (d / "config.json").write_text(json.dumps({"model_type": "fish_omni", "audio_decoder_config": tower,
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
