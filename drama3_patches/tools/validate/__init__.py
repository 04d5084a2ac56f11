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

Before anything starts, the host is checked (``preflight``: vLLM and vLLM-Omni installed and
paired as ``doctor`` says, what the tiny model needs): a bare host gets one line and exit 2. It
writes ``report.md`` (the verdict table for a pull request, and where a row failed, the first
failing row with the likely cause and fix from the log's known signatures), ``report.json``, the
server's log, ``host-facts.md`` (what an Ascend bug report asks for), the deploy file it served
and the audio to ``--out``. It exits 0 only when every check passed, 1 when one failed, 2 on bad
input, 128 + the signal's number when a signal (Ctrl-C, SIGTERM, SIGHUP) cut it short; the report
is written and the server's every process stopped however it ends. The server's environment is
this process's, plus the report folder and the two runtime checks: ``DRAMA3_PATCHES`` is the
operator's to export, so a run without it shows what an unpatched deployment does.

Modules: ``preflight`` (the host), ``deploy`` (the served file), ``server`` (start, wait, stop the
process group), ``logscan`` (the log, read once as it grows), ``diagnose`` (failure signatures),
``facts`` (the host's facts), ``phases`` (the requests), ``evidence`` (reports, counts),
``verdict`` (the checks and the report), ``profile`` (the per-frame time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

# What a run writes in --out; --force removes these first (nothing else of the folder is touched).
OUTPUTS = ("reports", "audio", "refs", "profile", "report.json", "report.md", "server.log", "deploy.yaml",
           "host-facts.md", "diagnosis.txt", "metrics.txt")
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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
    p.add_argument("--force", action="store_true", help="use --out even if it holds files (an earlier run's "
                                                        "outputs there are removed first)")
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
    r.add_argument("--port", type=int, help="the server's port on 127.0.0.1 (default: a free one; give it when a "
                                            "firewall or a scraper such as Prometheus needs to know it)")
    r.add_argument("--start-timeout", type=float, default=1800, help="seconds to wait for the server (default 1800)")
    r.add_argument("--request-timeout", type=float, default=600, help="seconds per request (default 600)")
    r.add_argument("--stop-grace", type=float, default=60,
                   help="seconds the server's processes get to end on TERM before KILL (default 60)")
    r.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    r.add_argument("--require-stall-free", type=float, metavar="C",
                   help="fail row g unless every concurrency-1 stream plays without a stall when its player starts "
                        "C seconds of wall time after its first audio, D <= C (for the cards: a CPU host is slow)")
    r.add_argument("--no-profile", action="store_true", help="skip the per-frame time (stage 0 is then served "
                                                            "without a profiler_config)")
    r.add_argument("--profile-steps", type=int, default=24,
                   help="decode steps in the per-frame time window (default 24)")
    p.set_defaults(func=run)


def _check_args(args):
    """Every argument checked before anything runs; returns ``--out`` as an ``outdir.OutFolder``
    (an existing one checked and held open; made after the host check otherwise)."""
    from drama3_patches import env
    from drama3_patches.tools.files import InputError
    from drama3_patches.tools.validate.outdir import OutFolder

    if args.port is not None:
        _check_port(args.port)
    if args.require_stall_free is not None and not 0 <= args.require_stall_free < 3600:
        raise InputError("--require-stall-free must be between 0 and 3600 seconds of audio")
    for flag in ("clones", "clone_frames", "preempt_requests", "preempt_frames", "kv_blocks", "max_model_len",
                 "bench_concurrency", "bench_requests", "profile_steps"):
        if getattr(args, flag) < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    for flag in ("stagger",):
        if not 0 <= getattr(args, flag) < 3600:
            raise InputError(f"--{flag} must be between 0 and 3600 seconds")
    for flag in ("start_timeout", "request_timeout", "stop_grace"):
        if not 0 < getattr(args, flag) < 1e6:
            raise InputError(f"--{flag.replace('_', '-')} must be a number of seconds above 0")
    if args.model and not (Path(args.model) / "config.json").is_file():
        raise InputError(f"--model {args.model}: no config.json there; give a Drama 3 checkpoint folder")
    problem = env.fault_problem()
    if problem:  # a misspelt negative control must not run as a normal run
        raise InputError(problem)
    out = OutFolder(args.out)
    out.check(force=args.force)  # last: an InputError above leaves no descriptor open
    return out


def _check_port(port: int) -> None:
    """``--port``: in range and free on 127.0.0.1 now (the server binds it there), so a port
    taken fails here in one line rather than as a start-up failure minutes later."""
    import socket

    from drama3_patches.tools.files import InputError

    if not 0 < port < 65536:
        raise InputError(f"--port must be between 1 and 65535, got {port}")
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise InputError(f"--port {port}: 127.0.0.1:{port} is not free ({exc.strerror}); give another "
                             "port or leave --port out") from None


def _clear_outputs(out) -> None:
    """An earlier run's outputs, removed through the checked folder's descriptor (links removed,
    never followed): its reports would be read as this run's, its audio listed beside this run's."""
    out.clear(OUTPUTS)


class Interrupted(BaseException):
    """A signal cut the run short (Ctrl-C, SIGTERM, SIGHUP): judged, reported, stopped all the same."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Signals:
    """SIGINT, SIGTERM and SIGHUP take one path: the first raises :class:`Interrupted` (unless the run
    is already finishing); every later one, and any while finishing, is only noted, so that no
    second signal can skip writing the report or stopping the server."""

    def __init__(self, say) -> None:
        self.say = say
        self.first: int | None = None
        self.finishing = False
        self._deferring = False
        self._pending = False
        self._old: dict = {}

    def __enter__(self):
        for sig in SIGNALS:
            self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handler(self, signum, frame) -> None:
        raising = self.first is None and not self.finishing
        if self.first is None:
            self.first = signum
        if raising and self._deferring:
            self._pending = True  # raised when deferred() ends
            return
        if raising:
            raise Interrupted(signum)
        self.say(f"{signal.Signals(signum).name}: already finishing; writing the report and stopping the server "
                 "first (it cannot be skipped)")

    def finish(self) -> None:
        self.finishing = True

    @contextlib.contextmanager
    def deferred(self):
        """A first signal taken inside is raised (:class:`Interrupted`) only when the block ends, so
        that what the block assigns (the server's handle, from fork to return) is assigned. Python
        runs its signal handlers in the main thread only, whichever thread the kernel delivered the
        signal to, so this holds against every thread; masking signals in the main thread alone
        would not (numpy's and torch's threads take a process-directed signal)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending:
            self._pending = False
            if not self.finishing:
                raise Interrupted(self.first)

    @property
    def exit_code(self) -> int | None:
        return None if self.first is None else 128 + self.first


def run(args) -> int:
    from drama3_patches import env
    from drama3_patches.tools.validate import deploy as deploys
    from drama3_patches.tools.validate import preflight

    out = _check_args(args)
    try:
        name, loaded = deploys.load(args.profile or (None if args.deploy else "910b-tp2-ep"), args.deploy)
        preflight.check(need_tiny_model=not args.model)
        out.create()
        if args.force:
            _clear_outputs(out)
    except BaseException:
        out.close()
        raise
    began, started_at = time.monotonic(), time.time()

    def say(msg: str) -> None:
        print(f"validate [{time.monotonic() - began:6.0f} s] {msg}", file=sys.stderr, flush=True)

    if not env.enabled():
        say(f"warning: {env.ENABLE} is not enabled in this environment: the server runs without the patches")
    umask = os.umask(0o077)  # what validate and the server make in --out is this user's alone
    try:
        with Signals(say) as signals:
            return _run(args, name, loaded, out, began, started_at, say, signals)
    finally:
        os.umask(umask)
        out.close()


def _run(args, name, loaded, out, began: float, started_at: float, say, signals: Signals) -> int:
    from drama3_patches import env
    from drama3_patches.engine.state import host_label
    from drama3_patches.tools.validate import deploy as deploys
    from drama3_patches.tools import isolated_python
    from drama3_patches.tools.validate import facts, logscan, phases, server, verdict

    from drama3_patches.tools.validate import profile

    scale = deploys.Scale(kv_blocks=args.kv_blocks, max_model_len=args.max_model_len, frames=args.clone_frames)
    served = deploys.scaled(loaded, scale, None if args.no_profile else profile.profiler_config(
        out / profile.TRACE_DIR, args.profile_steps, profile.DELAY))
    tp = deploys.tp_size(served)
    run_ = verdict.Run(profile=name, model=args.model or str(out / "model"), tp=tp,
                       ep=deploys.expert_parallel(served), compiled=deploys.compiles(served), scale=scale,
                       notes=list(args.note))
    reports, log = out / "reports", out / "server.log"  # the server's, by path: see _same_folder
    scan = logscan.LogScan(log)
    ctx = _Context(args, run_, out, reports, scan, tp, say, started_at, host_label())
    srv = gathering = None
    failure: Exception | None = None
    try:
        try:
            if not args.model:
                from drama3_patches.tools import tiny_model

                say(f"making a tiny Drama 3 checkpoint ({args.tiny_depth} depth) in {out / 'model'}")
                model = out.folder("model")
                try:  # made through the checked folder's descriptor, whatever its path names now
                    tiny_model.make(Path(f"/proc/self/fd/{model.fd}"), args.tiny_depth, args.tiny_fp8)
                finally:
                    model.close()
            import yaml

            out.write("deploy.yaml", yaml.safe_dump(served, sort_keys=False))
            server_env = isolated_python.environ(dict(os.environ, **logscan.SERVER_ENV, **{env.REPORT_DIR: str(reports),
                                                                     env.RESUME_CHECK: "1"}))
            if tp > 1:
                server_env[env.TP_CHECK] = "1"
            refs = out.folder("refs")
            try:
                lines = phases.write_references(refs, max(args.clones, args.preempt_requests, args.bench_requests))
            finally:
                refs.close()
            port = args.port or server.free_port()
            say(f"starting vllm serve --omni ({name}: stage 0 at TP{tp}, {'compiled' if run_.compiled else 'eager'}); "
                f"log: {log}")
            _same_folder(out)
            with out.open_new("server.log") as log_file, signals.deferred():
                # a signal now is taken once srv is set: a started server never lacks its handle
                srv = server.start(run_.model, out / "deploy.yaml", port, server_env, log_file)
            gathering = facts.Background()  # the host's facts, while the server starts
            _phases(ctx, srv, port, lines)
            signals.finish()
        except Interrupted as exc:  # judge what ran: the report keeps it
            signals.finish()
            what = signal.Signals(exc.signum).name
            run_.ended = f"interrupted by {what}"
            run_.notes.append(f"interrupted by {what} before every phase ran")
            say(f"{what}: judging what ran, then stopping the server")
        except Exception as exc:  # a bug of ours: the server is still stopped and the report written
            signals.finish()
            failure = exc
            run_.ended = f"stopped by an error in validate ({type(exc).__name__}: {exc})"
        signals.finish()
        if gathering is not None and run_.ended != "completed":
            gathering.stop()  # the run is ending: the host facts no longer wait on their children
        _judge(ctx, srv)
        run_.write(out)
        if ctx.profiling:  # a signal cut the profile window short: its stop now, bounded, after the report
            why = profile.stop_after_signal(ctx.url)
            if why:
                run_.notes.append(f"/stop_profile after the signal: {why}")
    finally:
        signals.finish()
        if srv is not None:
            say("stopping the server (every process of its group)")
            run_.stopped = srv.stop(grace=args.stop_grace)
            if run_.stopped["left"]:
                say(f"warning: {len(run_.stopped['left'])} process(es) of the server would not end: "
                    f"pid {', '.join(map(str, run_.stopped['left']))}")
        if srv is not None and not out.same_path():
            run_.ended = "the --out path was replaced while the server ran"
            run_.notes.append(f"{out.path} no longer names the folder validate checked and wrote: the server was "
                              "given paths under it, so what it read and wrote cannot be trusted")
        if gathering is not None:
            found = gathering.result()
            out.write("host-facts.md", facts.markdown(found))
            run_.facts = facts.summary(found)
        run_.wall_s = time.monotonic() - began
        run_.write(out)
    if failure is not None:
        raise failure
    print(run_.markdown())
    say(f"{'PASSED' if run_.passed else 'FAILED'}: {out / 'report.md'}")
    if signals.exit_code is not None:
        return signals.exit_code
    return 0 if run_.passed else 1


def _same_folder(out) -> None:
    """The server is handed paths under ``--out`` (the model, the deploy file, the report folder):
    InputError unless they still name the folder validate checked and wrote through its descriptor."""
    from drama3_patches.tools.files import InputError

    if not out.same_path():
        raise InputError(f"--out {out.path} no longer names the folder validate checked (it was renamed or "
                         "replaced since); the server was not started")


def _save_audio(out, phase, prefix: str) -> list[str]:
    """``phases.save_audio`` into ``OUT/audio``, made and written through the folder's descriptor."""
    from drama3_patches.tools.validate import phases

    audio = out.folder("audio")
    try:
        return phases.save_audio(phase, audio, prefix)
    finally:
        audio.close()


@dataclasses.dataclass
class _Context:
    args: object
    run: object
    out: object  # outdir.OutFolder
    reports: Path
    scan: object
    tp: int
    say: object
    since: float  # the run's start (time.time()): reports last written before it are an earlier run's
    host: str
    url: str = ""  # the server's, once started
    profiling: bool = False  # inside the profile window (stage 0's profiler started)

    def roles(self) -> dict:
        return self.scan.role_map(multi_rank_stage=0 if self.tp > 1 else None)

    def counts(self) -> dict:
        """Stage 0's counters, once every process has flushed its last counts."""
        from drama3_patches.tools.validate import evidence

        time.sleep(evidence_flush_s())
        self.scan.poll()
        procs, _ = evidence.processes(str(self.reports), self.roles(), self.since, self.host)
        return {name: evidence.stage0_count(procs, name) for name in evidence.COUNTERS}


def _phases(ctx: _Context, srv, port: int, lines: list) -> None:
    """Phases a, b, c and g against the started server; each adds its check to ``ctx.run``."""
    from drama3_patches.tools.validate import phases, server

    args, run_, out, say, scan = ctx.args, ctx.run, ctx.out, ctx.say, ctx.scan
    url = ctx.url = f"http://127.0.0.1:{port}"

    def tick(waited: float) -> None:
        scan.poll()
        say(f"  still starting ({waited:.0f} s)")

    ready, waited, why = server.wait_ready(srv, port, args.start_timeout, tick=tick)
    scan.poll()
    run_.startup(ready, waited, why, scan.stage0_graphs(ctx.roles()))
    say(f"a. start-up: {'ready' if ready else 'FAILED'} after {waited:.0f} s {why}")
    if not ready:
        return
    say(f"b. {args.clones} voice clones, {args.stagger:g} s apart")
    clones = phases.send(url, lines[:args.clones], frames=args.clone_frames, seed=1000,
                         stagger=args.stagger, timeout=args.request_timeout)
    run_.clones(clones, _save_audio(out, clones, "clone"))
    say(f"   {clones.completed}/{len(clones.sent)} complete, {clones.overlaps()} overlapping, {clones.wall_s:.0f} s")
    srv.note_tree()
    say(f"c. {args.preempt_requests} requests of {args.preempt_frames} frames into a {args.kv_blocks}-block KV pool")
    before = ctx.counts()
    # A request is preempted only when it must grow into a new KV block while the pool is full:
    # prompts near a block's end (PREEMPT_TEXT) that then grow by --preempt-frames.
    long_ = [dataclasses.replace(line, text=f"{i}: {phases.PREEMPT_TEXT}", prompt_text="a clip")
             for i, line in enumerate(lines[:args.preempt_requests])]
    preempted = phases.send(url, long_, frames=args.preempt_frames, seed=2000, stagger=0.0,
                            timeout=args.request_timeout)
    after = ctx.counts()
    run_.preemption(preempted, before, after, _save_audio(out, preempted, "preempted"))
    say(f"   {preempted.completed}/{len(preempted.sent)} complete; preemptions "
        f"{after['preemptions'] - before['preemptions']}, resumes verified "
        f"{after['resumes_verified'] - before['resumes_verified']}, {preempted.wall_s:.0f} s")
    srv.note_tree()
    levels = sorted({1, args.bench_concurrency})
    say(f"g. bench at concurrency {', '.join(map(str, levels))}, {args.bench_requests} requests each")
    t0 = time.monotonic()
    run_.bench(phases.bench_levels(url, lines[:args.bench_requests], levels, args.request_timeout),
               time.monotonic() - t0, require_stall_free=args.require_stall_free)
    scan.poll()
    if not args.no_profile:
        from drama3_patches.tools.validate import profile

        ctx.profiling = True
        run_.frame_time = profile.window(url, lines[0], out, srv, run_.bench_levels, args, say)
        ctx.profiling = False
        scan.poll()


def _judge(ctx: _Context, srv) -> None:
    """Rows d, e, f and the verdict, from what the run left (the server still up: its shutdown's
    own lines are not the run's); the diagnosis where a row failed."""
    from drama3_patches.tools.validate import evidence, verdict

    run_, scan = ctx.run, ctx.scan
    counts = ctx.counts() if srv is not None else dict.fromkeys(evidence.COUNTERS, 0)
    if run_.ready and srv.poll() is None:
        # what the patches' series said on vLLM's own /metrics, kept beside the report
        from drama3_patches.tools.validate import metrics

        # after a signal the run is ending: a server that does not answer holds it a few seconds only
        scraped = metrics.save(ctx.url, ctx.out, timeout=30 if run_.ended == "completed" else 5)
        if "error" in scraped:
            run_.notes.append(f"/metrics not saved: {scraped['error']}")
    scan.poll()
    scan.finish()
    procs, skipped = evidence.processes(str(ctx.reports), ctx.roles(), ctx.since, ctx.host)
    not_run = run_.ended if run_.ended != "completed" else "the server never became ready"
    run_.final(counts, procs, skipped, scan, not_run=not_run)
    run_.diagnose(scan.found)
    if run_.first_failed is not None:
        ctx.out.write("diagnosis.txt", "\n".join(run_.diagnosis) + "\n\nThe log's last lines:\n"
                      + "\n".join(scan.tail) + "\n")
    run_.versions = verdict.versions()


def evidence_flush_s() -> float:
    """Long enough for every process to have written its last counts (engine.state.FLUSH_DELAY_S)."""
    from drama3_patches.engine.state import FLUSH_DELAY_S

    return FLUSH_DELAY_S + 1.5
