"""``drama3-patches validate`` without a server: its bad-input lines, the served deploy, the roles
it reads from a vLLM-Omni log, the log lines it flags, and how checks become the verdict. The
real run is the e2e tier's (tests/e2e/test_validate.py) and the cards' (tests/hardware).
"""

from __future__ import annotations

import json

import pytest

from drama3_patches.tools.bench.speech import Result
from drama3_patches.tools.validate import deploy, evidence, phases, server, verdict
from support.subproc import run_cli


@pytest.mark.parametrize("args, says", [
    (["--profile", "nope"], "unknown profile 'nope'"),
    (["--clones", "0"], "--clones must be at least 1"),
    (["--stagger", "-1"], "--stagger must be between 0 and 3600"),
    (["--model", "{tmp}"], "no config.json there"),
    (["--deploy", "{tmp}/deploy.yaml"], "no stage with stage_id 0"),
    (["--deploy", "{tmp}/missing.yaml"], "missing.yaml"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    (tmp_path / "deploy.yaml").write_text("stages: []\n")
    done = run_cli("validate", "--out", str(tmp_path / "out"), *[a.format(tmp=tmp_path) for a in args])
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


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
(Worker_TP0 pid=13) INFO 12-04 [fish_omni_model.py:1] Loaded DAC codec encoder for voice references
(Worker_TP1 pid=14) INFO 12-04 [gpu_model_runner.py:1] Model loading took 0.1 GiB
(StageEngineCoreProc_stage1_replica0 pid=15) INFO 12-04 [core.py:1] init engine
(Worker pid=16) INFO 12-04 [fish_speech_dac_decoder.py:1] DAC codec loaded from codec.pth
"""


def test_roles_come_from_the_log_prefixes_and_what_each_worker_loads():
    roles = server.process_roles(server._ANSI.sub("", LOG), multi_rank_stage=0)
    assert roles == {11: "api-server", 12: "engine-core stage 0", 13: "worker stage 0 rank 0",
                     14: "worker stage 0 rank 1", 15: "engine-core stage 1", 16: "worker stage 1 rank 0"}
    # without knowing which stage spans ranks, a rank that logged nothing of its loading stays unplaced
    assert server.process_roles(LOG)[14] == "worker stage ?"


def test_flagged_log_lines_skip_advice_records_but_not_errors_or_tracebacks():
    advice = ("(APIServer pid=1) WARNING 12-04 [model.py:2660] positions exceeding derived_max_model_len "
              "will cause a CUDA array out-of-bounds error.")
    bad = ["(Worker_TP1 pid=2) ERROR 12-04 [x.py:1] HCCL error: timed out waiting for rank 0",
           "Traceback (most recent call last):",
           "(Worker pid=3) INFO 12-04 [y.py:2] ResumedHistoryMismatch: request 7: resumed with 5 frames",
           "RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB"]
    count, shown = evidence.bad_lines("\n".join([advice, *bad, "(Worker pid=3) INFO 12-04 all good"]))
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


def _sent(samples: int, rate=44100, ok=True, frames=10):
    r = Result("x", ok=ok, error="" if ok else "HTTP 500", audio_s=samples / rate, sample_rate=rate)
    return phases.Sent("x", r, frames)


def test_a_request_counts_only_in_whole_44k_frames_within_what_it_asked():
    assert _sent(10 * 2048).problem() is None
    assert "not a whole number" in _sent(10 * 2048 + 5).problem()
    assert "between 1 and 10" in _sent(11 * 2048).problem()
    assert "not 44100 Hz" in _sent(4096, rate=24000).problem()
    assert _sent(0, ok=False).problem() == "x: HTTP 500"


def test_the_verdict_passes_only_when_every_phase_ran_and_passed():
    run = verdict.Run(profile="p", model="m", tp=2, ep=False, compiled=False,
                      scale=deploy.Scale(kv_blocks=20, max_model_len=512, frames=10))
    run.startup(False, 31.0, "the server exited with status 1 before it was ready", "")
    run.final(dict.fromkeys(evidence.COUNTERS, 0), [], [], "")
    doc = json.loads(run.json())
    assert not doc["passed"] and [c["passed"] for c in doc["checks"]] == [False] * 7
    assert {c["name"][0]: c["detail"] for c in doc["checks"]}["b"] == "not run: the server never became ready"
    assert set(doc["counts"]) == {"requests_completed", "voice_clones_completed", "preemptions",
                                  "resumes_verified", "tp_steps_checked"}
    md = run.markdown()
    assert md.startswith("## drama3-patches validate: FAILED") and md.count("**FAIL**") == 7


def test_no_report_folder_is_no_process_rather_than_an_error(tmp_path):
    assert evidence.processes(str(tmp_path / "never-made"), {}) == ([], [])
