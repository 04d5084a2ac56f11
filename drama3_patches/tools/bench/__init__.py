"""``drama3-patches bench``: Seed-TTS-Eval style streaming load test of /v1/audio/speech.

Modules: ``speech`` (the streaming client and per-level figures), ``wer`` and
``sim`` (Seed-TTS-Eval's scores), ``audio`` (the clips they score),
``progress`` (stderr), ``plot`` (``--plot``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time


def register(sub) -> None:
    p = sub.add_parser("bench", help="stream Seed-TTS-Eval lines through /v1/audio/speech at several concurrencies")
    p.add_argument("--url", required=True, help="server base URL (http://host:port) or the full speech endpoint URL")
    p.add_argument("--meta", required=True, help="Seed-TTS-Eval meta.lst: utt_id|prompt_text|prompt_wav|target_text")
    p.add_argument("--concurrency", default="1,16,32,64", help="comma-separated levels (default 1,16,32,64)")
    p.add_argument("--limit", type=int, default=64, help="lines per level (default 64)")
    p.add_argument("--seed", type=int, default=42, help="shuffle seed (default 42)")
    p.add_argument("--warmup", type=int, default=2, help="requests before each level, not counted (default 2)")
    p.add_argument("--model", help="served model name (default: the server's)")
    p.add_argument("--response-format", choices=("wav", "pcm"), default="wav")
    p.add_argument("--stream-format", choices=("sse", "audio"), default="sse")
    p.add_argument("--sample-rate", type=int, help="ask for this rate; required with --response-format pcm")
    p.add_argument("--ref-audio", choices=("data", "file"), default="data",
                   help="send references inline as base64 (data) or as file:// URIs the server reads (file)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="wall-clock seconds per request, from the send to the last byte, however slowly the "
                        "server streams; a request past it is failed (default 600)")
    w = p.add_argument_group("WER and SIM (Seed-TTS-Eval; local models only, never downloaded)")
    w.add_argument("--whisper", metavar="PATH",
                   help="local Whisper model for WER: a transformers folder or an openai-whisper .pt file")
    w.add_argument("--asr-backend", choices=("auto", "transformers", "openai-whisper"), default="auto",
                   help="how to load --whisper (default auto: a file is openai-whisper, a folder transformers)")
    w.add_argument("--transcriber", metavar="MODULE:FUNCTION",
                   help="instead of --whisper: a callable taking mono float32 16 kHz audio, returning text")
    w.add_argument("--wer-method", choices=("seed-tts-eval", "whisper"), default="seed-tts-eval",
                   help="seed-tts-eval (default): its punctuation stripping, mean of per-utterance WER; "
                        "whisper: Whisper's English normalizer, corpus WER")
    w.add_argument("--sim-model", metavar="PATH", help="local transformers WavLMForXVector folder for SIM")
    w.add_argument("--sim-embedder", metavar="MODULE:FUNCTION",
                   help="instead of --sim-model: a callable taking mono float32 16 kHz audio, returning an "
                        "embedding (Seed-TTS-Eval's WavLM-large ECAPA-TDNN plugs in here)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="OUT", help="write every figure and every request to OUT "
                                                 "(vllm bench serve's key names; TTFT there is TTFA)")
    o.add_argument("--plot", metavar="OUT.png", help="draw audio s/s and TTFA p50/p99 against concurrency, the CDF "
                                                     "of the cushion each stream needs, and per level the p50, p90 "
                                                     "and worst streams received and played against time")
    o.add_argument("--reference", choices=("port",), help="with --plot: add the port's published numbers")
    o.add_argument("--force", action="store_true", help="overwrite an existing --json or --plot file")
    o.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run)


def _fail(msg: str) -> int:
    print(f"drama3-patches bench: {msg}", file=sys.stderr)
    return 2


def _check_args(args) -> str | None:
    """The usage error, or None."""
    from drama3_patches.tools.bench.speech import check_url

    try:
        args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        return f"--concurrency wants comma-separated integers, got {args.concurrency!r}"
    if not args.levels or min(args.levels) < 1 or args.limit < 1 or args.warmup < 0:
        return "--concurrency levels and --limit must be at least 1, --warmup at least 0"
    if args.response_format == "pcm" and not args.sample_rate:
        return "--response-format pcm has no header: give --sample-rate"
    if args.sample_rate is not None and args.sample_rate < 1:
        return f"--sample-rate must be at least 1, got {args.sample_rate}"
    if not args.timeout > 0 or args.timeout == float("inf"):
        return f"--timeout must be a number of seconds above 0, got {args.timeout:g}"
    url_problem = check_url(args.url)
    if url_problem:
        return url_problem
    if args.whisper and args.transcriber:
        return "give --whisper or --transcriber, not both"
    if args.sim_model and args.sim_embedder:
        return "give --sim-model or --sim-embedder, not both"
    if args.reference and not args.plot:
        return "--reference draws into the plot: give --plot OUT.png too"
    # Outputs are checked before the run, which can take hours, rather than after it.
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib (pip install matplotlib)"
    for flag, out in (("--plot", args.plot), ("--json", args.json)):
        if out:
            folder = os.path.dirname(os.path.abspath(out))
            if not os.path.isdir(folder):
                return f"{flag} {out}: folder {folder} does not exist"
            if os.path.isdir(out):
                return f"{flag} {out} is a folder; give a file name"
            if os.path.lexists(out) and not args.force:
                return f"{flag} {out} exists; pass --force to overwrite it"
    return None


def _scorers(args, log):
    """(transcribe, wer_note, sim_scorer, sim_note): a scorer, or None and the reason."""
    from drama3_patches.tools.bench import sim, wer

    transcribe, sim_scorer = None, None
    wer_note = wer.unavailable(args.wer_method, args.whisper, args.transcriber)
    if wer_note is None:
        try:
            transcribe, what = wer.load_transcriber(args.whisper, args.asr_backend, args.transcriber)
            log(f"bench: WER ({args.wer_method}) by {what}")
        except Exception as exc:  # a model that does not load: measure anyway, say why WER is missing
            wer_note = f"cannot load {args.whisper or args.transcriber}: {type(exc).__name__}: {exc}"
    sim_note = sim.unavailable(args.sim_model, args.sim_embedder)
    if sim_note is None:
        try:
            embed, what = sim.load_embedder(args.sim_model, args.sim_embedder)
            sim_scorer = sim.Scorer(embed)
            log(f"bench: SIM by {what}")
        except Exception as exc:
            sim_note = f"cannot load {args.sim_model or args.sim_embedder}: {type(exc).__name__}: {exc}"
    return transcribe, wer_note, sim_scorer, sim_note


def _skip_notes(s: dict) -> list[str]:
    out = []
    for key, what in (("wer_skipped", "WER"), ("sim_skipped", "SIM")):
        for item in s.get(key) or []:
            out.append(f"  {what} not scored: {item['utt']}: {item['reason']}")
    return out


def _measure(args, lines, settings, scorers, notes, results: list) -> None:
    """Each level in turn, appended to ``results`` once measured and scored (so a Ctrl-C keeps
    every level that completed)."""
    from drama3_patches.tools.bench import progress
    from drama3_patches.tools.bench import speech as sb
    from drama3_patches.tools.files import printable

    (transcribe, sim_scorer), (wer_note, sim_note) = scorers, notes
    scoring = transcribe is not None or sim_scorer is not None
    by_utt = {line.utt: line for line in lines}
    for c in args.levels:
        level = sb.run_level(lines, c, settings, warmup=args.warmup,
                             progress=progress.make(sys.stderr, len(lines), f"concurrency {c}", args.quiet))
        if scoring and level.ok:
            sb.score_level(level, by_utt, transcribe, sim_scorer, args.wer_method,
                           progress=progress.make(sys.stderr, len(level.ok), f"concurrency {c} scoring",
                                                  args.quiet))
        level.wer_note = wer_note or ("" if level.wer is not None else "no completed stream to transcribe")
        level.sim_note = sim_note or ("" if level.sim is not None else "no completed stream to compare")
        for r in level.results:
            r.audio = b""  # scored: the samples are not kept across levels
        s = level.result()
        for f in s["failures"]:  # the server's words: no control character reaches the terminal
            print(printable(f"  failed: {f['utt']}: {f['error']}"), file=sys.stderr)
        for note in _skip_notes(s):
            print(printable(note), file=sys.stderr)
        results.append(s)


def run(args) -> int:
    from drama3_patches.tools.bench import speech as sb

    error = _check_args(args)
    if error:
        return _fail(error)
    try:
        lines = sb.pick_lines(sb.read_meta(args.meta), args.seed, args.limit)
        for line in lines:
            if args.ref_audio == "data":
                sb.read_ref(line.prompt_wav)  # readable, a regular file, within MAX_REF_BYTES
    except sb.BenchError as exc:
        return _fail(str(exc))

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    transcribe, wer_note, sim_scorer, sim_note = _scorers(args, log)
    scoring = transcribe is not None or sim_scorer is not None
    settings = sb.Settings(url=args.url, model=args.model, response_format=args.response_format,
                           stream_format=args.stream_format, sample_rate=args.sample_rate, timeout=args.timeout,
                           ref_audio=args.ref_audio, keep_audio=scoring)
    log(f"bench: {len(lines)} lines (seed {args.seed}) x concurrency {args.levels}, {args.warmup} warm-up "
        f"request(s) per level, {args.url}")
    results, interrupted = [], None
    try:
        _measure(args, lines, settings, (transcribe, sim_scorer), (wer_note, sim_note), results)
    except KeyboardInterrupt:
        done = len(results)
        interrupted = (f"interrupted (Ctrl-C): {done} of {len(args.levels)} concurrency level(s) completed "
                       "and are kept" + (f"; {args.levels[done:]} not measured" if done < len(args.levels) else ""))
        print(f"drama3-patches bench: {interrupted}", file=sys.stderr)

    if results:
        print(sb.table(results, wer_note, sim_note))
    status = 130 if interrupted else 0 if all(s["failed"] == 0 for s in results) else 1
    if args.plot and results:
        from drama3_patches.tools.bench import plot

        title = f"{len(lines)} lines per level, {args.url}"
        try:
            plot.write_png(args.plot, results, plot.REFERENCES.get(args.reference), title)
        except (OSError, ValueError) as exc:
            print(f"drama3-patches bench: cannot write {args.plot}: {exc}", file=sys.stderr)
            status = 1
    if args.json:
        doc = {"date": time.strftime("%Y%m%d-%H%M%S"), "model_id": args.model, "num_prompts": len(lines),
               "url": args.url, "meta": args.meta, "seed": args.seed, "limit": args.limit, "warmup": args.warmup,
               "percentiles": list(sb.PERCENTILES),
               "ttft_is": "time to first audio: request sent to the first audio sample bytes (WAV header excluded)",
               "lines": [line.utt for line in lines], "wer_method": args.wer_method, "wer_note": wer_note,
               "sim_note": sim_note, "interrupted": interrupted, "levels": results}
        try:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=2)
        except OSError as exc:
            print(f"drama3-patches bench: cannot write {args.json}: {exc.strerror}", file=sys.stderr)
            return 1
    return status
