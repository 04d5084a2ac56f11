"""vLLM-Omni 0.32.0rc1's API server (``vllm serve MODEL --omni --deploy-config FILE``) serves
Drama 3 on CPU with the patches, driven by ``drama3-patches bench`` as an operator drives it:
streaming ``/v1/audio/speech`` voice clones; ``status --collect`` then shows which process of
the deployment applied which patch.
"""

from __future__ import annotations

import json

import pytest

from support import e2e_pipeline as ep
from support.subproc import run_cli

pytestmark = pytest.mark.e2e

MAX_FRAMES = 10
FRAME_S = ep.CODEC_HOP / ep.CODEC_SAMPLE_RATE


def test_api_server_streams_speech_to_bench_and_reports_patches(model_dir, tmp_path):
    deploy = ep.write_deploy(tmp_path / "deploy.yaml", max_tokens=MAX_FRAMES)
    reports, log, port = tmp_path / "reports", tmp_path / "server.log", ep.free_port()
    server = ep.start_server(model_dir, deploy, port, ep.env(report_dir=reports), log)
    try:
        ready_s = ep.wait_ready(server, port, log)
        print(f"server ready in {ready_s:.1f} s")
        meta, out = ep.write_meta(tmp_path), tmp_path / "bench.json"
        bench = run_cli("bench", "--url", f"http://127.0.0.1:{port}", "--meta", str(meta), "--concurrency", "2",
                        "--limit", "2", "--warmup", "0", "--json", str(out), "--quiet", timeout=900)
        print(bench.stdout, bench.stderr)
        assert bench.returncode == 0, bench.stderr
        collected = run_cli("status", "--collect", str(reports))
    finally:
        ep.stop_server(server)
    print(collected.stdout)
    levels = json.loads(out.read_text())["levels"]
    # one level of two concurrent requests: the engine batches them (a second level only costs CI time)
    assert [lv["max_concurrency"] for lv in levels] == [2]
    for level in levels:
        assert (level["completed"], level["failed"]) == (2, 0), level["failures"]
        assert level["audio_throughput"] > 0 and level["request_throughput"] > 0
        for req in level["requests"]:
            # the WAV stream bench parsed: the codec's rate, mono, whole frames, first audio before the end
            assert (req["sample_rate"], req["channels"]) == (ep.CODEC_SAMPLE_RATE, 1), req
            frames = req["audio_seconds"] / FRAME_S
            assert 1 <= round(frames) <= MAX_FRAMES and abs(frames - round(frames)) < 1e-6, req
            assert 0 < req["ttft"] <= req["latency"], req
    assert collected.returncode == 0, collected.stdout + collected.stderr
    # which process is which (the reports carry pids; the server's log names each pid's role)
    roles = ep.process_roles(log.read_text(errors="replace"))
    applied = ep.applied_patches(reports)
    for pid in sorted(roles):
        print(f"{pid}  {roles[pid]:40s} applied: {sorted(p for p, pids in applied.items() if pid in pids)}")
    reported = {roles.get(pid, f"unknown {pid}") for pid in ep.reported_pids(reports)}
    assert reported == {"APIServer", "StageEngineCoreProc_stage0_replica0", "Worker_stage0",
                        "StageEngineCoreProc_stage1_replica0", "Worker_stage1"}, reported
    # the fish_omni kernels run where the model runs (stage 0's worker); the API server imports them too
    assert {roles[pid] for pid in applied.get("tower-sampler-eager", [])} >= {"Worker_stage0"}, applied
