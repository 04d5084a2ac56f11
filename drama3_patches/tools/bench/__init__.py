"""``drama3-patches bench``: Seed-TTS-Eval style streaming load test of /v1/audio/speech."""

from __future__ import annotations

import json
import sys


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
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--whisper", metavar="PATH", help="local Whisper model for WER (never downloaded)")
    p.add_argument("--json", metavar="OUT", help="write every figure and every request to OUT")
    p.set_defaults(func=run)


def run(args) -> int:
    from drama3_patches.tools.bench import speech as sb

    def fail(msg: str) -> int:
        print(f"drama3-patches bench: {msg}", file=sys.stderr)
        return 2

    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        return fail(f"--concurrency wants comma-separated integers, got {args.concurrency!r}")
    if not levels or min(levels) < 1 or args.limit < 1 or args.warmup < 0:
        return fail("--concurrency levels and --limit must be at least 1, --warmup at least 0")
    if args.response_format == "pcm" and not args.sample_rate:
        return fail("--response-format pcm has no header: give --sample-rate")
    if not args.url.startswith(("http://", "https://")):
        return fail(f"--url must start with http:// or https://, got {args.url!r}")
    try:
        lines = sb.pick_lines(sb.read_meta(args.meta), args.seed, args.limit)
        for line in lines:
            if args.ref_audio == "data":
                with open(line.prompt_wav, "rb"):
                    pass
    except sb.BenchError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"{exc.filename}: cannot read reference audio: {exc.strerror}")

    wer_note = sb.wer_unavailable(args.whisper)
    transcribe = None
    if wer_note is None:
        try:
            transcribe = sb.make_transcriber(args.whisper)
        except Exception as exc:  # a model that does not load: measure anyway, say why WER is missing
            wer_note = f"cannot load {args.whisper}: {type(exc).__name__}: {exc}"
    settings = sb.Settings(url=args.url, model=args.model, response_format=args.response_format,
                           stream_format=args.stream_format, sample_rate=args.sample_rate, timeout=args.timeout,
                           ref_audio=args.ref_audio, keep_audio=transcribe is not None)
    print(f"bench: {len(lines)} lines (seed {args.seed}) x concurrency {levels}, {args.warmup} warm-up "
          f"request(s) per level, {args.url}", file=sys.stderr)
    texts = {line.utt: line.text for line in lines}
    summaries = []
    for c in levels:
        level = sb.run_level(lines, c, settings, warmup=args.warmup, progress=sys.stderr)
        if transcribe is not None:
            sb.score_level(level, texts, transcribe)
        level.wer_note = wer_note or ""
        s = level.summary()
        for f in s["failures"]:
            print(f"  failed: {f['utt']}: {f['error']}", file=sys.stderr)
        summaries.append(s)

    print(sb.table(summaries, wer_note))
    if args.json:
        doc = {"url": args.url, "meta": args.meta, "seed": args.seed, "limit": args.limit, "warmup": args.warmup,
               "lines": [line.utt for line in lines], "levels": summaries, "wer_note": wer_note}
        try:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=2)
        except OSError as exc:
            print(f"drama3-patches bench: cannot write {args.json}: {exc.strerror}", file=sys.stderr)
            return 1
    return 0 if all(s["failed"] == 0 for s in summaries) else 1
