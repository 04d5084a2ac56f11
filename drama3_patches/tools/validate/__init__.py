"""``drama3-patches validate``: the evidence a review of an Ascend deployment asks for, in one run.

It starts the real ``vllm serve MODEL --omni`` with a deploy profile's stage placement (stage 0's
KV pool made small, so that requests preempt one another), then runs its phases against it:

a. start-up: time to ready, and graph capture where stage 0 compiles;
b. streaming voice clones with staggered arrivals (one request's prefill beside the others'
   decode), each complete in whole 44.1 kHz frames;
c. preemption and slot reuse forced by the small KV pool, every resumed request's frame history
   verified by content (``DRAMA3_PATCHES_RESUME_CHECK``), counted for this phase alone;
d. at stage-0 tensor parallel > 1, the ranks' frames compared every step
   (``DRAMA3_PATCHES_TP_CHECK``), with the number of steps compared;
e. every process's patch report against what its role should show;
f. no device, collective or traceback line in the server's log;
g. a short ``bench`` pass at concurrency 1 and N: TTFA, audio seconds per second, RTF, and the
   playout figures (stalls, the cushion a player needs; ``--require-stall-free C``);

then, unless ``--no-profile``, the per-frame time: a window of decode steps at concurrency 1 under
vLLM's profiler (``profile``), reported in its own section.

It writes ``report.md`` (the verdict table for a pull request), ``report.json``, the server's log,
the deploy file it served and the audio to ``--out``, and exits 0 only when every check passed
(1 when one failed, 2 on bad input). The server's environment is this process's, plus the report
folder and the two runtime checks: ``DRAMA3_PATCHES`` is the operator's to export, so a run
without it shows what an unpatched deployment does.

Modules: ``deploy`` (the served file), ``server`` (start, wait, log, roles), ``phases`` (the
requests), ``evidence`` (reports, counts, log lines), ``verdict`` (the checks and the report),
``profile`` (the per-frame time).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

STAGES = ("start-up", "voice clones", "preemption", "rank agreement", "patch states", "server log", "bench")


def register(sub) -> None:
    p = sub.add_parser("validate", help="serve Drama 3 with vLLM-Omni and collect the evidence a review asks "
                                        "for: start-up, streaming clones, preemption, rank agreement, patches")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", help="a shipped deploy profile (drama3-patches deploy-config --list); "
                                       "default 910b-tp2-ep")
    src.add_argument("--deploy", metavar="FILE", help="a vLLM-Omni deploy YAML of your own")
    p.add_argument("--model", metavar="DIR", help="the checkpoint to serve (default: a tiny published-format "
                                                  "model made in OUT/model; drama3-patches tiny-model)")
    p.add_argument("--tiny-depth", choices=("tiny", "published"), default="tiny",
                   help="without --model: the tiny model's depth (default tiny)")
    p.add_argument("--tiny-fp8", action="store_true", help="without --model: block-FP8 experts (the cards' path)")
    p.add_argument("--out", metavar="DIR", required=True, help="where the report, log, deploy and audio go")
    p.add_argument("--force", action="store_true", help="use --out even if it holds files")
    r = p.add_argument_group("the run")
    r.add_argument("--clones", type=int, default=3, help="voice clones in phase b (default 3)")
    r.add_argument("--stagger", type=float, default=1.0, help="seconds between their arrivals (default 1)")
    r.add_argument("--clone-frames", type=int, default=10, help="frames per clone in phases b and g (default 10)")
    r.add_argument("--preempt-requests", type=int, default=4, help="requests at once in phase c (default 4)")
    r.add_argument("--preempt-frames", type=int, default=48, help="frames per request in phase c (default 48)")
    r.add_argument("--kv-blocks", type=int, default=20,
                   help="stage 0's KV pool in blocks: room for two of phase c's requests at admission but not "
                        "once they grow, so that one is preempted (default 20, sized for the tiny model at TP2)")
    r.add_argument("--max-model-len", type=int, default=512, help="stage 0's longest request (default 512)")
    r.add_argument("--bench-concurrency", type=int, default=2, help="the second bench level (default 2)")
    r.add_argument("--bench-requests", type=int, default=2, help="requests per bench level (default 2)")
    r.add_argument("--start-timeout", type=float, default=1800, help="seconds to wait for the server (default 1800)")
    r.add_argument("--request-timeout", type=float, default=600, help="seconds per request (default 600)")
    r.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    r.add_argument("--require-stall-free", type=float, metavar="C",
                   help="fail row g unless every concurrency-1 stream plays without a stall once C seconds of "
                        "audio are buffered (for the cards; a CPU host is far slower than real time)")
    r.add_argument("--no-profile", action="store_true", help="skip the per-frame time (stage 0 is then served "
                                                            "without a profiler_config)")
    r.add_argument("--profile-steps", type=int, default=24,
                   help="decode steps in the per-frame time window (default 24)")
    p.set_defaults(func=run)


def _check_args(args) -> None:
    from drama3_patches.tools.files import InputError

    if args.require_stall_free is not None and not 0 <= args.require_stall_free < 3600:
        raise InputError("--require-stall-free must be between 0 and 3600 seconds of audio")
    for flag in ("clones", "clone_frames", "preempt_requests", "preempt_frames", "kv_blocks", "max_model_len",
                 "bench_concurrency", "bench_requests", "profile_steps"):
        if getattr(args, flag) < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    for flag in ("stagger",):
        if not 0 <= getattr(args, flag) < 3600:
            raise InputError(f"--{flag} must be between 0 and 3600 seconds")
    for flag in ("start_timeout", "request_timeout"):
        if not 0 < getattr(args, flag) < 1e6:
            raise InputError(f"--{flag.replace('_', '-')} must be a number of seconds above 0")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not args.force)):
        raise InputError(f"--out {out} exists and is not an empty folder; give a new one, or --force")
    if args.model and not (Path(args.model) / "config.json").is_file():
        raise InputError(f"--model {args.model}: no config.json there; give a Drama 3 checkpoint folder")


def run(args) -> int:
    from drama3_patches import env
    from drama3_patches.tools.validate import deploy as deploys
    from drama3_patches.tools.validate import evidence, phases, server, verdict

    _check_args(args)
    name, loaded = deploys.load(args.profile or (None if args.deploy else "910b-tp2-ep"), args.deploy)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()

    def say(msg: str) -> None:
        print(f"validate [{time.monotonic() - began:6.0f} s] {msg}", file=sys.stderr, flush=True)

    if not env.enabled():
        say(f"warning: {env.ENABLE} is not enabled in this environment: the server runs without the patches")
    model = args.model
    if not model:
        from drama3_patches.tools import tiny_model

        say(f"making a tiny Drama 3 checkpoint ({args.tiny_depth} depth) in {out / 'model'}")
        model = str(tiny_model.make(out / "model", args.tiny_depth, args.tiny_fp8))
    scale = deploys.Scale(kv_blocks=args.kv_blocks, max_model_len=args.max_model_len, frames=args.clone_frames)
    from drama3_patches.tools.validate import profile

    served = deploys.scaled(loaded, scale, None if args.no_profile else profile.profiler_config(
        out / profile.TRACE_DIR, args.profile_steps, profile.DELAY))
    tp = deploys.tp_size(served)
    import yaml

    (out / "deploy.yaml").write_text(yaml.safe_dump(served, sort_keys=False))
    reports = out / "reports"
    server_env = dict(os.environ, **{env.REPORT_DIR: str(reports), env.RESUME_CHECK: "1"})
    if tp > 1:
        server_env[env.TP_CHECK] = "1"
    lines = phases.write_references(out / "refs", max(args.clones, args.preempt_requests, args.bench_requests))
    run_ = verdict.Run(profile=name, model=model, tp=tp, ep=deploys.expert_parallel(served),
                       compiled=deploys.compiles(served), scale=scale, notes=list(args.note))
    log, port = out / "server.log", server.free_port()
    say(f"starting vllm serve --omni ({name}: stage 0 at TP{tp}, {'compiled' if run_.compiled else 'eager'}); "
        f"log: {log}")
    proc = server.start(model, out / "deploy.yaml", port, server_env, log)
    interrupted = False
    try:
        try:
            _phases(args, run_, proc, port, out, reports, log, lines, tp, say)
        except KeyboardInterrupt:  # judge what ran: the report keeps it
            interrupted = True
            run_.notes.append("interrupted (Ctrl-C) before every phase ran")
            say("interrupted: judging what ran, then stopping the server")
        time.sleep(evidence_flush_s())
        end = log.stat().st_size  # the shutdown's own lines are not the run's
        run_.final(_counts(reports, log, tp), *evidence.processes(str(reports), _roles(log, tp, end)),
                   server.read_log(log, end), not_run="interrupted" if interrupted else "the server never became ready")
    finally:
        say("stopping the server")
        server.stop(proc)
    run_.versions = verdict.versions()
    run_.wall_s = time.monotonic() - began
    (out / "report.json").write_text(run_.json())
    (out / "report.md").write_text(run_.markdown())
    print(run_.markdown())
    say(f"{'PASSED' if run_.passed else 'FAILED'}: {out / 'report.md'}")
    return 130 if interrupted else 0 if run_.passed else 1


def _phases(args, run_, proc, port: int, out: Path, reports: Path, log: Path, lines: list, tp: int, say) -> None:
    """Phases a, b, c and g against the started server; each adds its check to ``run_``."""
    from drama3_patches.tools.validate import phases, server

    url = f"http://127.0.0.1:{port}"
    ready, waited, why = server.wait_ready(proc, port, args.start_timeout,
                                           tick=lambda s: say(f"  still starting ({s:.0f} s)"))
    run_.startup(ready, waited, why, server.read_log(log))
    say(f"a. start-up: {'ready' if ready else 'FAILED'} after {waited:.0f} s {why}")
    if not ready:
        return
    say(f"b. {args.clones} voice clones, {args.stagger:g} s apart")
    clones = phases.send(url, lines[:args.clones], frames=args.clone_frames, seed=1000,
                         stagger=args.stagger, timeout=args.request_timeout)
    run_.clones(clones, phases.save_audio(clones, out / "audio", "clone"))
    say(f"   {clones.completed}/{len(clones.sent)} complete, {clones.overlaps()} overlapping, {clones.wall_s:.0f} s")
    say(f"c. {args.preempt_requests} requests of {args.preempt_frames} frames into a {args.kv_blocks}-block KV pool")
    before = _counts(reports, log, tp)
    # A request is preempted only when it must grow into a new KV block while the pool is full:
    # prompts near a block's end (PREEMPT_TEXT) that then grow by --preempt-frames.
    long_ = [dataclasses.replace(line, text=f"{i}: {phases.PREEMPT_TEXT}", prompt_text="a clip")
             for i, line in enumerate(lines[:args.preempt_requests])]
    preempted = phases.send(url, long_, frames=args.preempt_frames, seed=2000, stagger=0.0,
                            timeout=args.request_timeout)
    after = _counts(reports, log, tp)
    run_.preemption(preempted, before, after, phases.save_audio(preempted, out / "audio", "preempted"))
    say(f"   {preempted.completed}/{len(preempted.sent)} complete; preemptions "
        f"{after['preemptions'] - before['preemptions']}, resumes verified "
        f"{after['resumes_verified'] - before['resumes_verified']}, {preempted.wall_s:.0f} s")
    levels = sorted({1, args.bench_concurrency})
    say(f"g. bench at concurrency {', '.join(map(str, levels))}, {args.bench_requests} requests each")
    t0 = time.monotonic()
    run_.bench(phases.bench_levels(url, lines[:args.bench_requests], levels, args.request_timeout),
               time.monotonic() - t0, require_stall_free=args.require_stall_free)
    if not args.no_profile:
        from drama3_patches.tools.validate import profile

        run_.frame_time = profile.window(url, lines[0], out, proc, run_.bench_levels, args, say)


def evidence_flush_s() -> float:
    """Long enough for every process to have written its last counts (engine.state.FLUSH_DELAY_S)."""
    from drama3_patches.engine.state import FLUSH_DELAY_S

    return FLUSH_DELAY_S + 1.5


def _roles(log: Path, tp: int, end: int | None = None) -> dict:
    from drama3_patches.tools.validate import server

    return server.process_roles(server.read_log(log, end), multi_rank_stage=0 if tp > 1 else None)


def _counts(reports: Path, log: Path, tp: int) -> dict:
    from drama3_patches.tools.validate import evidence

    time.sleep(evidence_flush_s())
    if not reports.is_dir():
        return dict.fromkeys(evidence.COUNTERS, 0)
    procs, _ = evidence.processes(str(reports), _roles(log, tp))
    return {name: evidence.stage0_count(procs, name) for name in evidence.COUNTERS}
