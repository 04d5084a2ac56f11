"""``validate``'s per-frame time (``tools/validate/profile.py``): the profiler config stage 0 is
served with, the trace reader, and the attribution of each step's time.

The traces here are built event by event in the layout vLLM 0.32's torch profiler writes on a CPU
host (Chrome trace JSON, gzipped, ``traceEvents`` after the metadata; the step annotation, the
Python tracer's ``nn.Module: X_N`` and ``file.py(N): function`` records, CPU ops), with the names
the CPU rehearsal's trace holds; every duration is chosen, so each component's expected figure is
known exactly.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import pytest

from drama3_patches.tools.files import InputError
from drama3_patches.tools.validate import profile

FWD = "vllm_omni/model_executor/models/fish_omni/fish_omni_model.py(407): forward"
COMPILE = "vllm/compilation/decorators.py(524): __call__"
QWEN = "vllm/model_executor/models/qwen3_next.py(698): forward"
TOWER_FWD = "vllm_omni/model_executor/models/fish_omni/codebook_tower.py(159): forward"
MAIN = "vllm_omni/model_executor/models/fish_omni/sampling.py(46): main_tokens"
CODE = "vllm_omni/model_executor/models/fish_omni/sampling.py(79): code"
SAMPLE = "vllm/v1/worker/gpu_worker.py(1293): sample_tokens"
STEP = "execute_context_0(0)_generation_1(1)"
PID, TID = 100, 100


class Trace:
    """Events on one thread, placed by a cursor in microseconds."""

    def __init__(self):
        self.events = [{"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "args": {"name": "python"}}]

    def x(self, name, cat, ts, dur, **extra):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": TID, "ts": ts, "dur": dur,
                            "args": extra.pop("args", {"Ev Idx": len(self.events)}), **extra})

    def py(self, name, ts, dur):
        self.x(name, "python_function", ts, dur)

    def op(self, name, ts, dur):
        self.x(name, "cpu_op", ts, dur)

    def noise(self, ts, dur, n=20):
        """Python calls the attribution never reads (the Triton interpreter's, on a CPU host)."""
        for i in range(n):
            self.py(f"triton/language/core.py({i}): __hash__", ts + i * dur / n, dur / n / 2)
            self.py("<built-in function isinstance>", ts + i * dur / n + dur / n / 2, dur / n / 4)

    def step(self, t, *, backbone=1000.0, layers=3, layer=200.0, heads=2, head=50.0, main=80.0, code=30.0,
             glue=100.0, prep=300.0, sample=70.0, idle=150.0, forward=True, annotate=True, modules=True,
             renamed=False, tower=True, nested=False):
        """One decode step from ``t``; returns (end of the period, its expected components in ms).

        ``renamed``: the backbone's records carry a subclass's names (vLLM-Ascend's kind: another
        class, another file); ``tower=False``: the tower runs but leaves no record of its own;
        ``nested``: the sampler's ``code`` calls run inside the last tower layer's record."""
        qwen, layer_cls = (("vllm_ascend/patch/worker/patch_qwen3_5.py(88): forward", "AscendQwen3_5DecoderLayer")
                           if renamed else (QWEN, "Qwen3_5DecoderLayer"))
        start = t
        t += prep  # the runner's input preparation (outside the forward)
        self.noise(start, prep)
        fwd_start = t
        parts = []
        t += glue / 2
        parts.append(("backbone", t, backbone))
        t += backbone
        parts.append(("sampler", t, main))
        t += main
        for i in range(layers):
            parts.append(("tower", t, layer, i))
            t += layer
        for _ in range(heads):
            parts.append(("head", t, head))
            t += head
            if nested:  # inside the last layer, in its second half
                parts.append(("code", fwd_start + glue / 2 + backbone + main + layers * layer - (_ + 1) * code - 5,
                              code))
            else:
                parts.append(("code", t, code))
                t += code
        t += glue / 2
        fwd_dur = t - fwd_start
        if forward:
            self.py(COMPILE, fwd_start - 1, fwd_dur + 2)
            self.py(FWD, fwd_start, fwd_dur)
        for part in parts:
            kind, ts, dur = part[0], part[1], part[2]
            if kind == "backbone":
                if forward:
                    self.py(COMPILE, ts - 0.5, dur + 1)
                    self.py(qwen, ts, dur)
                for k in range(2):  # decoder layers: modules and ops inside the backbone
                    if modules:
                        self.py(f"nn.Module: {layer_cls}_{k}", ts + 1 + k * dur / 2, dur / 2 - 2)
                        self.py("nn.Module: ReplicatedLinear_0", ts + 2 + k * dur / 2, 10)
                    self.op("_C::onednn_mm", ts + 2.5 + k * dur / 2, 8)
                    self.op("_C::cpu_fused_moe", ts + 20 + k * dur / 2, dur / 4)
            elif kind == "sampler":
                if forward:
                    self.py(MAIN, ts, dur)
                self.op("aten::topk", ts + 1, dur / 2)
            elif kind == "tower":
                if modules and tower:
                    self.py(f"nn.Module: TowerLayer_{part[3]}", ts, dur)
                    self.py("nn.Module: Linear_0", ts + 2, 10)  # a linear inside a layer is the layer's time
                if forward and tower:
                    self.py(TOWER_FWD, ts + 1, dur - 2)
                self.op("aten::mm", ts + 3, 8)
            elif kind == "head":
                if modules and tower:
                    self.py("nn.Module: Linear_1", ts, dur)
                self.op("aten::linear", ts + 1, dur - 2)
                self.op("aten::mm", ts + 2, dur - 4)  # the linear's child: its self time is 2 us
            elif forward:
                self.py(CODE, ts, dur)
        self.op("aten::where", fwd_start + 1, glue / 4)  # forward glue
        t += 40  # the runner's output handling, still inside the annotated range
        if annotate:
            self.x(STEP, "user_annotation", start, t - start)
        if forward:
            self.py(SAMPLE, t, sample)
        self.op("aten::copy_", t + 1, sample / 2)
        t += sample + idle
        sm = main + heads * code
        bb, tw = backbone, (layers * layer + heads * head - (heads * code if nested else 0)) * tower
        # what no kept record covers: the forward's own Python (its glue less the op in it), and the
        # idle time between steps
        rest = glue / 4
        expected = {"backbone": bb / 1e3, "tower": tw / 1e3, "sampler": sm / 1e3, "rest_of_forward": rest / 1e3,
                    "outside_forward": (prep + 40 + sample) / 1e3,
                    "unattributed": (fwd_dur - bb - tw - sm - rest + idle) / 1e3}
        return t, expected

    def write(self, path: Path, gz: bool = True) -> Path:
        doc = {"schemaVersion": 1, "deviceProperties": [], "with_stack": 1, "traceEvents": self.events,
               "traceName": str(path)}
        text = json.dumps(doc, indent=1)
        if gz:
            path.write_bytes(gzip.compress(text.encode()))
        else:
            path.write_text(text)
        return path


def _steps(trace, n=4, t=1000.0, **kw):
    exp = []
    for i in range(n):
        t, e = trace.step(t, backbone=1000.0 + 100 * i, **kw)
        exp.append((t, e))
    return exp


def _read(tr, tmp_path, name="dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz", **kw):
    return profile.read(tr.write(tmp_path / name), **kw)


def _mean(exp, key, n):
    return sum(e[key] for _, e in exp[:n]) / n


def test_each_component_of_a_step_is_the_time_its_own_records_cover(tmp_path):
    tr = Trace()
    tr.step(0.0, backbone=5000.0)
    first = [e for e in tr.events if e.get("name") == STEP][0]
    first["name"] = "execute_context_1(120)_generation_0(0)"  # a prefill step: not a decode step
    exp = _steps(tr, n=4, t=10000.0)
    ft = _read(tr, tmp_path)
    # 4 decode steps: the last has no successor, so 3 periods; the prefill is left out
    assert ft["steps"] == 3 and ft["rank"] == "0" and ft["steps_from"] == "vLLM's step annotation"
    starts = [10000.0] + [t for t, _ in exp]
    periods = [(starts[i + 1] - starts[i]) / 1e3 for i in range(3)]
    assert ft["step_ms"]["mean"] == pytest.approx(sum(periods) / 3)
    assert ft["step_ms"]["p50"] == pytest.approx(sorted(periods)[1])
    for key in profile.COMPONENTS:
        assert ft["components_ms"][key] == pytest.approx(_mean(exp, key, 3)), key
    # the forward's own Python and the idle time between steps: no record covers them
    assert ft["unattributed_ms"] == pytest.approx(_mean(exp, "unattributed", 3))
    assert ft["problems"] == []
    assert ft["rules"]["backbone"].startswith("structure: the forward's first call holding decoder layers (2 x ")
    assert ft["rules"]["tower"].startswith("structure:") and ft["rules"]["sampler"].startswith("structure:")


def test_a_backbone_under_another_class_and_file_is_found_by_its_place(tmp_path):
    """vLLM-Ascend replaces classes: the backbone's records carry a subclass's names. The forward's
    first call holding a stack of decoder layers is still the backbone."""
    tr = Trace()
    exp = _steps(tr, n=3, t=0.0, renamed=True)
    ft = _read(tr, tmp_path)
    assert ft["components_ms"]["backbone"] == pytest.approx(_mean(exp, "backbone", 2))
    assert ft["rules"]["backbone"] == ("structure: the forward's first call holding decoder layers "
                                       "(2 x AscendQwen3_5DecoderLayer)")
    assert ft["problems"] == []


def test_a_tower_without_records_is_a_problem_and_its_time_is_not_given_to_another_component(tmp_path):
    tr = Trace()
    exp = _steps(tr, n=3, t=0.0, tower=False)
    ft = _read(tr, tmp_path)
    comps = ft["components_ms"]
    assert comps["tower"] == 0.0 and ft["rules"]["tower"] is None
    assert comps["backbone"] == pytest.approx(_mean(exp, "backbone", 2))
    assert comps["sampler"] == pytest.approx(_mean(exp, "sampler", 2))
    # the tower's ops (3 layers x 8 us, 2 heads x 48 us) are records inside the forward of no
    # component; the tower's other 0.58 ms have no record
    assert comps["rest_of_forward"] == pytest.approx(0.025 + (3 * 8 + 2 * 48) / 1e3)
    assert ft["unattributed_ms"] == pytest.approx(_mean(exp, "unattributed", 2) - 0.120)
    share = ft["unattributed_ms"] / ft["step_ms"]["mean"]
    assert ft["problems"] == [f"tower: no record matched in 2 of 2 steps; {share:.0%} of the step is unattributed"]
    md = "\n".join(profile.markdown(ft | {"window_s": 1}))
    assert "Problems:" in md and f"- {ft['problems'][0]}" in md
    assert "| tower | 0.00 | 0% | - |" in md
    assert "1 problem(s): tower: no record matched" in profile.summary(ft)


def test_a_sampler_nested_in_the_tower_is_counted_once_and_said(tmp_path):
    tr = Trace()
    exp = _steps(tr, n=3, t=0.0, nested=True)
    ft = _read(tr, tmp_path)
    for key in profile.COMPONENTS:
        assert ft["components_ms"][key] == pytest.approx(_mean(exp, key, 2)), key
    assert ft["unattributed_ms"] == pytest.approx(_mean(exp, "unattributed", 2))
    assert ft["problems"] == ["sampler: 4 of its records lie inside the tower's in 2 of 2 steps: counted once, "
                              "as the sampler's, and taken out of the tower"]
    assert all(v >= 0 for v in ft["components_ms"].values())


def test_top_ops_by_self_time(tmp_path):
    tr = Trace()
    _steps(tr, n=3, t=0.0)
    ft = profile.attribute(profile.load_events(tr.write(tmp_path / "t.pt.trace.json.gz")))
    ops = {o["name"]: o for o in ft["top_ops"]}
    # per step: the MoE op 2 x backbone/4 (backbone 1000 and 1100 us in the two periods)
    assert ops["_C::cpu_fused_moe"]["ms_per_step"] == pytest.approx((500 + 550) / 2 / 1e3)
    assert ft["top_ops"][0]["name"] == "_C::cpu_fused_moe"
    # aten::linear's self time excludes its aten::mm child: 2 heads x 2 us
    assert ops["aten::linear"]["ms_per_step"] == pytest.approx(0.004)
    # aten::mm: 3 layers x 8 us + 2 heads x 46 us
    assert ops["aten::mm"]["ms_per_step"] == pytest.approx((3 * 8 + 2 * 46) / 1e3)
    total = ft["step_ms"]["mean"] * 2
    assert ops["aten::mm"]["share"] == pytest.approx(2 * (3 * 8 + 2 * 46) / 1e3 / total)
    assert len(ft["top_ops"]) <= profile.TOP


def test_device_kernels_rank_the_top_ops_where_the_trace_has_them(tmp_path):
    tr = Trace()
    _steps(tr, n=3, t=0.0)
    for k in range(3):  # torch-npu's trace_view.json marks device tasks by their Task Type, ts as text
        tr.x("MatMulV2", "", f"{500.0 + k * 100:.3f}", 40.0, args={"Task Type": "AI_CORE"}, pid=7, tid=1)
    tr.x("GroupedMatmul", "kernel", 900.0, 300.0, pid=7, tid=1)
    ft = profile.attribute(profile.load_events(tr.write(tmp_path / "t.pt.trace.json.gz")))
    assert [o["name"] for o in ft["top_ops"]] == ["GroupedMatmul", "MatMulV2"]
    assert ft["top_ops"][1]["ms_per_step"] == pytest.approx(0.120 / 2)


def test_steps_without_any_model_record_say_so_for_each_component(tmp_path):
    """A compiled stage 0 replays a graph: the step is measured; its parts are problems, not zeros."""
    tr = Trace()
    _steps(tr, n=3, t=0.0, forward=False, modules=False)
    ft = _read(tr, tmp_path)
    assert ft["steps"] == 2 and ft["components_ms"]["backbone"] == 0.0
    assert ft["unattributed_ms"] == pytest.approx(ft["step_ms"]["mean"])
    assert [p.split(":")[0] for p in ft["problems"]] == ["forward", "backbone", "tower", "sampler"]
    assert ft["problems"][1] == "backbone: no record matched in 2 of 2 steps; 100% of the step is unattributed"
    assert ft["top_ops"][0]["name"] == "_C::cpu_fused_moe"  # the ops are still ranked
    assert "4 problem(s): forward: no record" in profile.summary(ft)


def test_module_records_without_python_calls_find_backbone_and_tower_by_their_place(tmp_path):
    """torch-npu with ``with_modules``: module records, no Python calls. The first run of decoder
    layers is the backbone, the modules after it the tower; the sampler and the forward leave no
    record, which the problems say."""
    tr = Trace()
    exp = _steps(tr, n=4, t=0.0, forward=False)
    ft = _read(tr, tmp_path)
    assert ft["steps"] == 3 and ft["steps_from"] == "vLLM's step annotation"
    comps = ft["components_ms"]
    # the decoder layers: two of backbone/2 - 2 us
    assert comps["backbone"] == pytest.approx(sum(e["backbone"] - 0.004 for _, e in exp[:3]) / 3)
    assert comps["tower"] == pytest.approx(_mean(exp, "tower", 3))
    assert ft["rules"]["backbone"] == "structure: the first stack of layers called (2 x Qwen3_5DecoderLayer)"
    assert comps["sampler"] == 0.0 and comps["rest_of_forward"] is None and comps["outside_forward"] is None
    assert ft["unattributed_ms"] == pytest.approx(ft["step_ms"]["mean"] - comps["backbone"] - comps["tower"])
    share = ft["unattributed_ms"] / ft["step_ms"]["mean"]
    assert ft["problems"] == [
        "forward: no record of the model's forward in 3 of 3 steps, so the rest of the forward and the time "
        "outside it are not measured",
        f"sampler: no record matched in 3 of 3 steps; {share:.0%} of the step is unattributed"]
    md = "\n".join(profile.markdown(ft | {"trace_dir": "x", "window_s": 3}))
    assert "| rest of forward | - | - | not measured |" in md
    assert f"| unattributed | {ft['unattributed_ms']:.2f} |" in md


def test_steps_from_the_towers_first_layer_where_no_step_is_annotated(tmp_path):
    """vllm-ascend's NPUWorker steps the profiler without opening a range: the tower's first layer,
    once per step, gives the cadence, and without a step's bounds the forward is not read whole."""
    tr = Trace()
    exp = _steps(tr, n=4, t=0.0, annotate=False)
    ft = _read(tr, tmp_path)
    assert ft["steps"] == 3 and ft["steps_from"].startswith("the codebook tower's first layer")
    starts = [e["ts"] for e in tr.events if e.get("name") == "nn.Module: TowerLayer_0"]
    periods = [(starts[i + 1] - starts[i]) / 1e3 for i in range(3)]
    assert ft["step_ms"]["mean"] == pytest.approx(sum(periods) / 3)
    comps, rules = ft["components_ms"], ft["rules"]
    # the next step's backbone, the tower of the period, its code draws and the next main draw
    assert comps["backbone"] == pytest.approx(sum(e["backbone"] for _, e in exp[1:4]) / 3)
    assert comps["tower"] == pytest.approx(_mean(exp, "tower", 3))
    assert comps["sampler"] == pytest.approx(_mean(exp, "sampler", 3))
    assert rules["backbone"].startswith("structure: the forward's first call holding decoder layers")
    assert rules["tower"].startswith("structure: the module calls from the tower's first layer to the backbone")
    assert comps["rest_of_forward"] is None and ft["problems"][0].startswith("forward: no step annotation")
    assert len(ft["problems"]) == 1


def test_a_trace_without_steps_is_an_error(tmp_path):
    tr = Trace()
    tr.op("aten::mm", 0.0, 10.0)
    with pytest.raises(profile.ProfileError, match="no two consecutive decode steps"):
        profile.attribute(profile.load_events(tr.write(tmp_path / "t.pt.trace.json.gz")))


def test_the_reader_is_bounded_and_knows_an_unfinished_file(tmp_path, monkeypatch):
    tr = Trace()
    _steps(tr, n=3, t=0.0)
    path = tr.write(tmp_path / "t.pt.trace.json.gz")
    plain = tr.write(tmp_path / "t.pt.trace.json", gz=False)
    kept = profile.load_events(path)
    assert len(kept) == len(profile.load_events(plain)) > 0
    # the Python calls nobody reads are dropped while parsing
    assert not any("triton" in e.name or "isinstance" in e.name for e in kept)
    cut = tmp_path / "cut.pt.trace.json.gz"
    cut.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(EOFError):
        profile.load_events(cut)
    half = tmp_path / "half.pt.trace.json"
    half.write_text(plain.read_text()[: len(plain.read_text()) // 2])
    with pytest.raises(ValueError, match="ends inside its traceEvents"):
        profile.load_events(half)
    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a Chrome trace"):
        profile.load_events(other)
    monkeypatch.setattr(profile, "_CHUNK", 1000)  # small pieces: events split across them
    assert len(profile.load_events(path)) == len(kept)
    monkeypatch.setattr(profile, "MAX_TRACE_JSON", 5000)
    with pytest.raises(InputError, match="profile fewer steps"):
        profile.load_events(path)
    monkeypatch.setattr(profile, "MAX_TRACE_BYTES", 100)
    with pytest.raises(InputError):
        profile.load_events(plain)


def _broken(tmp_path, name, mend_only: bool) -> tuple[Path, int]:
    """A trace of 3 steps as torch 2.13's exporter can write it: one record's name holding raw
    quotes (invalid JSON); with ``mend_only=False`` also one record without a colon (beyond
    mending). Returns the path and how many records the clean trace keeps."""
    tr = Trace()
    _steps(tr, n=3, t=0.0)
    tr.op("aten::QUOTEDQ", 50.0, 1.0)  # CPU ops the reader keeps, so what becomes of each is seen
    tr.op("aten::BROKEN", 60.0, 1.0)
    clean = profile.load_events(tr.write(tmp_path / "clean.pt.trace.json", gz=False))
    text = (tmp_path / "clean.pt.trace.json").read_text().replace("QUOTEDQ", '"pending"')
    if not mend_only:
        text = text.replace('"name": "aten::BROKEN"', '"name" "aten::BROKEN"')
    path = tmp_path / f"{name}.pt.trace.json"
    path.write_text(text)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)  # the input really is what the exporter's bug makes: not JSON
    return path, len(clean)


@pytest.mark.parametrize("chunk", [None, 1000])
def test_a_record_with_raw_quotes_in_its_name_is_mended_and_counted(tmp_path, monkeypatch, chunk):
    """A Python function named with quotes made validate's rehearsal give up on a complete trace
    ("ends inside its traceEvents list"). The record is mended (its quotes escaped), counted,
    and the table is read whole; ``chunk``: small pieces, so the bad record is met mid-stream."""
    path, n_clean = _broken(tmp_path, "mended", mend_only=True)
    if chunk:
        monkeypatch.setattr(profile, "_CHUNK", chunk)
        monkeypatch.setattr(profile, "MAX_RECORD", 2 * chunk)
    kept = profile.load_events(path)
    assert (kept.repaired, kept.dropped, len(kept)) == (1, 0, n_clean)
    assert any(e.name == 'aten::"pending"' for e in kept)
    ft = profile.read(path, events=kept)
    assert ft["records_repaired"] == 1 and ft["records_dropped"] == 0 and ft["problems"] == [] and ft["steps"] == 2


def test_a_record_beyond_mending_is_left_out_and_named_as_a_problem(tmp_path):
    path, n_clean = _broken(tmp_path, "dropped", mend_only=False)
    kept = profile.load_events(path)
    assert (kept.repaired, kept.dropped, len(kept)) == (1, 1, n_clean - 1)
    assert not any("BROKEN" in e.name for e in kept) and any(e.name == 'aten::"pending"' for e in kept)
    ft = profile.read(path, events=kept)
    assert ft["records_dropped"] == 1
    assert ft["problems"] == ["1 record(s) of the trace did not parse and were left out"]
    # the negative control: the same file cut inside a record is still an unfinished trace
    cut = tmp_path / "cut.pt.trace.json"
    cut.write_text(path.read_text()[: len(path.read_text()) * 2 // 3])
    with pytest.raises(ValueError, match="ends inside its traceEvents"):
        profile.load_events(cut)


def test_rank_zeros_newest_trace_is_read(tmp_path):
    old = Trace().write(tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz")
    os.utime(old, (time.time() - 100, time.time() - 100))
    Trace().write(tmp_path / "dp0_pp0_tp1_dcp0_ep0_rank1.3.pt.trace.json.gz")
    new = Trace().write(tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.2.pt.trace.json.gz")
    (tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.profiler_out.txt").write_text("table")
    assert profile.find_trace(tmp_path) == new
    assert profile.find_trace(tmp_path, since=time.time() + 100) is None
    # vLLM-Omni's and torch-npu's layouts
    omni = tmp_path / "omni" / "20261206-000000_stage0_rank0_1"
    omni.mkdir(parents=True)
    t = Trace().write(omni / "trace_rank0.json.gz")
    assert profile.find_trace(tmp_path / "omni") == t
    npu = tmp_path / "npu" / "stage0_rank0" / "host_1_2_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    npu.mkdir(parents=True)
    t = Trace().write(npu / "trace_view.json", gz=False)
    assert profile.find_trace(tmp_path / "npu") == t


def test_the_report_section_and_the_summary(tmp_path):
    tr = Trace()
    _steps(tr, n=4, t=0.0)
    ft = _read(tr, tmp_path)
    ft |= {"trace": "out/profile/t.pt.trace.json.gz", "trace_dir": "out/profile", "window_s": 12.0}
    md = "\n".join(profile.markdown(ft))
    assert "### Per-frame time (stage 0, concurrency 1)" in md
    assert "3 decode steps of rank 0 (steps from vLLM's step annotation)" in md
    assert f"a step every {ft['step_ms']['p50']:.1f} ms (p50)" in md
    for key, value in ft["components_ms"].items():
        assert f"| {key.replace('_', ' ')} | {value:.2f} |" in md
    assert f"| backbone | {ft['components_ms']['backbone']:.2f} | " in md and ft["rules"]["backbone"] + " |" in md
    assert f"| unattributed | {ft['unattributed_ms']:.2f} |" in md and "Problems:" not in md
    assert "| `_C::cpu_fused_moe` |" in md and "Trace: `out/profile/t.pt.trace.json.gz`" in md
    assert profile.summary(ft).startswith("3 steps of rank 0, a step every")
    err = {"error": "POST http://x/start_profile: HTTP 404", "window_s": 1.0}
    assert profile.markdown(err)[-2] == "Not measured: POST http://x/start_profile: HTTP 404."
    assert profile.markdown(None) == [] and profile.summary(None) == "not profiled"


# -- the served deploy --------------------------------------------------------------------------


def test_stage0_is_served_with_a_profiler_config_vllm_accepts(tmp_path):
    """The fields are vLLM 0.32's ``ProfilerConfig``'s (its own validation runs), and vLLM-Omni's
    check turns the profiler endpoints on for the served stages."""
    from drama3_patches.tools.validate import deploy

    cfg = profile.profiler_config(tmp_path / "profile", steps=4, delay=3)
    _, loaded = deploy.load("910b-tp2-ep", None)
    served = deploy.scaled(loaded, deploy.Scale(kv_blocks=20, max_model_len=512, frames=10), cfg)
    assert deploy.stage0(served)["profiler_config"] == cfg
    assert all("profiler_config" not in s for s in served["stages"] if s.get("stage_id", 0) != 0)
    assert "profiler_config" not in deploy.stage0(deploy.scaled(loaded, deploy.Scale(20, 512, 10)))
    config = pytest.importorskip("vllm.config")
    pc = config.ProfilerConfig(**cfg)
    assert (pc.profiler, pc.delay_iterations, pc.max_iterations, pc.ignore_frontend) == ("torch", 3, 5, True)
    assert pc.torch_profiler_dir == str(tmp_path / "profile") and pc.torch_profiler_with_stack
    utils = pytest.importorskip("vllm_omni.entrypoints.serve.profile.utils")
    assert utils._should_enable_profiler_endpoints(served["stages"])
    assert not utils._should_enable_profiler_endpoints(deploy.scaled(loaded, deploy.Scale(20, 512, 10))["stages"])


# -- the window against a stand-in server ------------------------------------------------------


def test_the_window_starts_and_stops_stage_0s_profiler_around_one_request(tmp_path):
    from support.speech_server import SpeechServer

    from drama3_patches.tools.bench.speech import MetaLine

    ref = tmp_path / "ref.wav"
    from support.speech_server import wav_header

    ref.write_bytes(wav_header(16000)[:-4] + (4).to_bytes(4, "little") + b"\0" * 4)
    trace_dir = tmp_path / "profile"
    line = MetaLine("line0", "a", str(ref), "pieces=0.1,0.1 gaps=0.05")

    def write_trace():
        tr = Trace()
        _steps(tr, n=3, t=0.0)
        trace_dir.mkdir(exist_ok=True)
        tr.write(trace_dir / "dp0_pp0_tp0_dcp0_ep0_rank0.5.pt.trace.json.gz")

    with SpeechServer() as server:
        server.on_stop_profile = write_trace
        ft = profile.measure(server.url, line, trace_dir, steps=2, delay=3, timeout=30)
        calls = [(r["path"], r.get("stages")) for r in server.requests]
        body = server.requests[1]
    assert calls == [("/start_profile", [0]), ("/v1/audio/speech", None), ("/stop_profile", [0])]
    assert body["max_new_tokens"] == 3 + 2 + 4 and body["seed"] == 3000
    assert "error" not in ft, ft
    assert ft["steps"] == 2 and ft["problems"] == [] and ft["trace"].endswith("rank0.5.pt.trace.json.gz")
    # frame-time on the saved trace gives the same figures as validate's frame_time
    from support.subproc import run_cli

    done = run_cli("frame-time", ft["trace"], "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {k: v for k, v in ft.items() if k not in ("trace_dir", "window_s")}
    text = run_cli("frame-time", ft["trace"])
    assert text.returncode == 0 and text.stdout.strip() == "\n".join(profile.table(ft) + [f"Trace: `{ft['trace']}`"])
    assert ft["window_s"] > 0


def test_the_window_says_why_when_the_server_has_no_profiler(tmp_path):
    from support.speech_server import SpeechServer

    from drama3_patches.tools.bench.speech import MetaLine

    with SpeechServer() as server:
        server.profiler = False
        ft = profile.measure(server.url, MetaLine("l", "a", str(tmp_path / "x.wav"), "t"), tmp_path / "p",
                             steps=2, delay=3, timeout=10)
    assert ft["error"].startswith(f"POST {server.url}/start_profile: HTTP 404")
    assert "served with a profiler_config" in ft["error"]


@pytest.mark.parametrize("args, says", [
    (["--require-stall-free", "-1"], "--require-stall-free must be between 0 and 3600"),
    (["--profile-steps", "0"], "--profile-steps must be at least 1"),
])
def test_validate_refuses_a_bad_cushion_or_window(tmp_path, args, says):
    from support.subproc import run_cli

    done = run_cli("validate", "--out", str(tmp_path / "out"), *args)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_window_is_skipped_when_the_server_is_not_serving(tmp_path):
    """After a failed row g (an engine stopped by a runtime check) or a server gone, the window
    says why it did not run instead of waiting on a dead engine."""
    import argparse

    class Proc:
        def __init__(self, code):
            self.returncode = code

        def poll(self):
            return self.returncode

    args = argparse.Namespace(profile_steps=2, request_timeout=5.0)
    said = []
    ft = profile.window("http://127.0.0.1:9", None, tmp_path, Proc(1), [], args, said.append)
    assert ft == {"error": "skipped: the server exited (status 1) before the window"} and said == []
    ft = profile.window("http://127.0.0.1:9", None, tmp_path, Proc(None), [{"failed": 0}, {"failed": 2}], args,
                        said.append)
    assert ft == {"error": "skipped: 2 of row g's requests failed, so the server is not serving"}
    assert profile.markdown(ft)[-2] == "Not measured: skipped: 2 of row g's requests failed, so the server is " \
                                       "not serving."


def test_a_function_of_torch_named_code_is_not_the_sampler(tmp_path):
    """torch.fx's ``GraphModule.code`` property is a call named ``code`` too: not the sampler's."""
    tr = Trace()
    exp = _steps(tr, n=3, t=0.0)
    for e in [e for e in tr.events if e.get("name") == "nn.Module: TowerLayer_0"]:
        tr.py("/venv/lib/python3.11/site-packages/torch/fx/graph_module.py(881): code", e["ts"] + 20, 5)
    ft = _read(tr, tmp_path)
    assert ft["problems"] == [] and ft["components_ms"]["sampler"] == pytest.approx(_mean(exp, "sampler", 2))
