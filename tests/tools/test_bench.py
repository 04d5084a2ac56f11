"""`drama3-patches bench` against a real HTTP server on 127.0.0.1 streaming synthetic audio.

The server injects the time to first audio, the audio length and the gaps; the
checks compare what the client measured with what was injected (lower bounds
from the injected sleeps, audio seconds exact from byte counts). Its samples
carry the words they "say", so WER is scored end to end through a plug-in
transcriber; the WER arithmetic itself is checked against jiwer's own numbers.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import random
import re
import struct
from pathlib import Path

import pytest

from drama3_patches.tools.bench import audio as ba
from drama3_patches.tools.bench import plot, progress, sim, wer
from drama3_patches.tools.bench import speech as sb
from support.speech_server import NATIVE_RATE, SpeechServer, embed, spoken_bytes, transcribe, wav_header
from support.subproc import ROOT, TESTS, run_cli

GAP, CHUNKS = 0.15, 4  # the stream goes on for 3 x GAP after the first samples
HEADER = ("| concurrency | audio s/s | TTFA p50 | TTFA p99 | RTF mean | D p50 | D p99 | C100 | WER | SIM | "
          "completed | failed |")


def _cli(*args, timeout=300):
    # tests/ on the path: the plug-in transcriber and embedder live in support.speech_server
    return run_cli("bench", *args, pythonpath=[TESTS], timeout=timeout)


def ref_wav(i: int) -> bytes:
    """A two-sample 16 kHz reference whose samples are both i/32768."""
    return wav_header(16000)[:-4] + struct.pack("<I", 4) + bytes([i, 0, i, 0])


def write_meta(d: Path, specs: list[str], prompts: list[str] | None = None) -> Path:
    (d / "wavs").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, spec in enumerate(specs):
        (d / "wavs" / f"ref{i}.wav").write_bytes(ref_wav(i))
        prompt = prompts[i] if prompts else f"prompt text {i}"
        lines.append(f"utt{i}|{prompt}|wavs/ref{i}.wav|{spec}")
    meta = d / "meta.lst"
    meta.write_text("\n".join(lines) + "\n")
    return meta


def bench(server, meta, *args, timeout=300):
    return _cli("--url", server.url, "--meta", str(meta), *args, timeout=timeout)


FIRSTS = [0.10, 0.15, 0.20, 0.25, 0.30, 0.35]
AUDIOS = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0]


def test_measured_figures_match_what_was_injected(tmp_path):
    specs = [f"first={f} header=0.02 audio={a} chunks={CHUNKS} gap={GAP}" for f, a in zip(FIRSTS, AUDIOS)]
    meta = write_meta(tmp_path, specs)
    out = tmp_path / "out.json"
    with SpeechServer() as server:
        r = bench(server, meta, "--concurrency", "1,3", "--limit", "6", "--warmup", "1", "--json", str(out))
        seen = list(server.requests)
        max_in_flight = server.max_in_flight
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())

    # Seed-42 shuffle, the same lines at both levels, one warm-up request before each.
    order = [f"utt{i}" for i in range(6)]
    random.Random(42).shuffle(order)
    assert doc["lines"] == order and doc["num_prompts"] == 6
    inputs = {f"utt{i}": s for i, s in enumerate(specs)}
    per_level = [seen[1:7], seen[8:14]]
    assert seen[0]["input"] == seen[7]["input"] == inputs[order[0]]  # warm-ups
    for reqs in per_level:
        assert sorted(q["input"] for q in reqs) == sorted(specs)
    assert max_in_flight == 3

    # What the server got: the clone reference inline, its transcript, a streamed wav request.
    q = seen[1]
    i = int(order[0][3:])
    ref = (tmp_path / "wavs" / f"ref{i}.wav").read_bytes()
    assert q["ref_audio"] == "data:audio/wav;base64," + base64.b64encode(ref).decode()
    assert q["ref_text"] == f"prompt text {i}"
    assert (q["stream"], q["stream_format"], q["response_format"], q["path"]) == (True, "sse", "wav",
                                                                                  "/v1/audio/speech")

    for level in doc["levels"]:
        assert (level["completed"], level["failed"], level["num_prompts"]) == (6, 0, 6)
        reqs = {x["utt"]: x for x in level["requests"]}
        for n in range(6):
            x = reqs[f"utt{n}"]
            assert x["success"] and x["error"] == ""
            assert x["audio_seconds"] == pytest.approx(AUDIOS[n], abs=1e-12)  # exact from the byte count
            assert x["sample_rate"] == NATIVE_RATE  # read from the WAV header
            # First samples come at `first`; the header alone (at 0.02 s) does not count,
            # and the stream goes on for 3 gaps more, which TTFA must not include (judged against
            # the request's own end, not a fixed bound: a loaded host delays the first chunk too).
            assert FIRSTS[n] <= x["ttft"] and x["latency"] - x["ttft"] > 2 * GAP
            assert x["latency"] >= FIRSTS[n] + 3 * GAP
            assert x["rtf"] == pytest.approx(x["latency"] / AUDIOS[n])
        ttfts = [x["ttft"] for x in level["requests"]]
        assert level["ttfts"] == ttfts and level["latencies"] == [x["latency"] for x in level["requests"]]
        assert level["median_ttft_ms"] == pytest.approx(sb.percentile(ttfts, 50) * 1e3)
        assert level["p99_ttft_ms"] == pytest.approx(sb.percentile(ttfts, 99) * 1e3)
        assert sorted(ttfts)[2] * 1e3 <= level["median_ttft_ms"] <= sorted(ttfts)[3] * 1e3
        assert level["audio_seconds"] == pytest.approx(sum(AUDIOS))
        assert level["audio_throughput"] == pytest.approx(sum(AUDIOS) / level["duration"])
        assert level["request_throughput"] == pytest.approx(6 / level["duration"])
        assert level["mean_rtf"] == pytest.approx(sum(x["rtf"] for x in level["requests"]) / 6)
        assert level["wer"] is None and level["wer_note"] == "no --whisper model path given"
        assert level["sim"] is None and level["sim_note"] == "no --sim-model or --sim-embedder given"
    c1, c3 = doc["levels"]
    assert (c1["max_concurrency"], c3["max_concurrency"]) == (1, 3)
    assert c1["duration"] >= sum(f + 3 * GAP for f in FIRSTS)  # one at a time
    assert c3["duration"] < c1["duration"]

    # The table: the port's published columns, the playout figures, SIM, completed/failed.
    lines = r.stdout.splitlines()
    assert lines[0] == HEADER
    assert lines[2].startswith(f"| 1 | {sb.sig3(c1['audio_throughput'])} | {sb.sig3(c1['median_ttft_ms'] / 1e3)} s | ")
    assert lines[3].endswith("| - | - | 6 | 0 |")
    assert "WER: - (no --whisper model path given)" in r.stdout
    assert "SIM: - (no --sim-model or --sim-embedder given)" in r.stdout
    # Progress on stderr, plain lines (not a terminal): done, completed, failed, elapsed.
    final = [ln for ln in r.stderr.splitlines() if ln.startswith("concurrency 3: 6/6 done")]
    assert len(final) == 1 and re.fullmatch(r"concurrency 3: 6/6 done, 6 completed, 0 failed, \d+\.\d s elapsed",
                                            final[0]), r.stderr
    assert "\r" not in r.stderr


def test_json_uses_vllm_bench_serve_key_names_and_statistics(tmp_path):
    """Every vLLM-named key is one that vLLM's serve benchmark writes, with its statistics (numpy's, in ms)."""
    np = pytest.importorskip("numpy")
    spec = importlib.util.find_spec("vllm.benchmarks.serve") if importlib.util.find_spec("vllm") else None
    if spec is None:
        pytest.skip("vllm is not installed")
    source = Path(spec.origin).read_text()
    meta = write_meta(tmp_path, [f"first={f} audio=0.3" for f in (0.05, 0.1, 0.2, 0.12)])
    with SpeechServer() as server:
        level = sb.run_level(sb.read_meta(str(meta)), 2, sb.Settings(url=server.url)).result()
    vllm_keys = ["duration", "completed", "failed", "request_throughput", "max_concurrency", "ttfts", "latencies",
                 "start_times", "errors"]
    for key in vllm_keys:
        assert f'"{key}"' in source, key
    # vLLM builds the latency keys as mean_/median_/std_<metric>_ms and p<percentile>_<metric>_ms.
    assert 'f"mean_{metric_attribute_name}_ms"' in source and 'f"p{p_word}_{metric_attribute_name}_ms"' in source
    assert '"ttft"' in source and '"e2el"' in source
    for metric, values in (("ttft", level["ttfts"]), ("e2el", level["latencies"])):
        v = np.array(values)
        assert level[f"mean_{metric}_ms"] == pytest.approx(v.mean() * 1000)
        assert level[f"median_{metric}_ms"] == pytest.approx(np.median(v) * 1000)
        assert level[f"std_{metric}_ms"] == pytest.approx(v.std() * 1000)
        for p in (50, 99):
            assert level[f"p{p}_{metric}_ms"] == pytest.approx(np.percentile(v, p) * 1000)
    assert level["request_throughput"] == pytest.approx(level["completed"] / level["duration"])


def test_failed_and_truncated_streams_are_counted_not_dropped(tmp_path):
    specs = ["audio=1.0 mode=ok", "audio=1.0 chunks=4 mode=error", "audio=1.0 chunks=4 mode=cut",
             "audio=1.0 mode=nodone", "mode=http500"]
    meta = write_meta(tmp_path, specs)
    out = tmp_path / "out.json"
    with SpeechServer() as server:
        r = bench(server, meta, "--concurrency", "2", "--limit", "5", "--warmup", "0", "--json", str(out))
    assert r.returncode == 1
    (level,) = json.loads(out.read_text())["levels"]
    assert (level["completed"], level["failed"]) == (1, 4)
    errors = {f["utt"]: f["error"] for f in level["failures"]}
    assert errors["utt1"] == "server error: injected failure"
    assert errors["utt2"].startswith("truncated stream")
    assert errors["utt3"] == "truncated stream: ended without speech.audio.done"
    assert errors["utt4"].startswith("HTTP 500")
    assert sorted(e for e in level["errors"] if e) == sorted(errors.values())
    # Partial audio of failed requests is discarded.
    assert level["audio_seconds"] == pytest.approx(1.0)
    for utt in errors:
        assert f"failed: {utt}: " in r.stderr
    assert "| 2 | " in r.stdout and r.stdout.splitlines()[2].endswith("| 1 | 4 |")
    assert re.search(r"concurrency 2: 5/5 done, 1 completed, 4 failed, \d+\.\d s elapsed", r.stderr), r.stderr


def test_raw_audio_stream_and_pcm_with_requested_rate(tmp_path):
    meta = write_meta(tmp_path, ["audio=1.5 chunks=3 first=0.05", "audio=0.5 chunks=2"])
    with SpeechServer() as server:
        out = tmp_path / "wav.json"
        r = bench(server, meta, "--concurrency", "1", "--limit", "2", "--warmup", "0", "--stream-format", "audio",
                  "--json", str(out))
        assert r.returncode == 0, r.stderr
        level = json.loads(out.read_text())["levels"][0]
        assert level["audio_seconds"] == pytest.approx(2.0)
        ttft = {x["utt"]: x["ttft"] for x in level["requests"]}
        assert ttft["utt0"] >= 0.05
        out = tmp_path / "pcm.json"
        r = bench(server, meta, "--concurrency", "2", "--limit", "2", "--warmup", "0", "--response-format", "pcm",
                  "--sample-rate", "24000", "--json", str(out))
        assert r.returncode == 0, r.stderr
        assert server.requests[-1]["sample_rate"] == 24000 and server.requests[-1]["response_format"] == "pcm"
    level = json.loads(out.read_text())["levels"][0]
    assert {x["utt"]: x["audio_seconds"] for x in level["requests"]} == {"utt0": pytest.approx(1.5),
                                                                         "utt1": pytest.approx(0.5)}
    assert {x["sample_rate"] for x in level["requests"]} == {24000}


def test_wer_and_sim_columns_say_why_they_are_empty(tmp_path):
    meta = write_meta(tmp_path, ["audio=0.2"])
    with SpeechServer() as server:
        r = bench(server, meta, "--concurrency", "1", "--limit", "1", "--warmup", "0", "--whisper",
                  str(tmp_path / "no-such-model"), "--sim-model", str(tmp_path / "no-sim"))
        assert r.returncode == 0, r.stderr
        assert f"WER: - ({tmp_path / 'no-such-model'} does not exist (models are never downloaded))" in r.stdout
        assert f"SIM: - ({tmp_path / 'no-sim'} does not exist (models are never downloaded))" in r.stdout
        # A folder that exists but holds no model: the run goes on and says why.
        (tmp_path / "empty").mkdir()
        r = bench(server, meta, "--concurrency", "1", "--limit", "1", "--warmup", "0", "--whisper",
                  str(tmp_path / "empty"))
        assert r.returncode == 0, r.stderr
        assert (f"WER: - (cannot load {tmp_path / 'empty'}: ValueError: {tmp_path / 'empty'}: not a transformers "
                "model folder (no config.json))") in r.stdout
        r = bench(server, meta, "--concurrency", "1", "--limit", "1", "--warmup", "0", "--transcriber",
                  "support.speech_server:no_such_function")
        assert "WER: - (cannot load support.speech_server:no_such_function: ValueError: " in r.stdout
        assert "has no no_such_function" in r.stdout


@pytest.mark.parametrize("case", ["no_meta", "bad_line", "pcm_no_rate", "bad_levels", "no_ref", "bad_url",
                                  "two_asr", "reference_without_plot", "plot_folder", "bad_port", "no_host",
                                  "json_folder", "meta_not_utf8", "huge_ref", "fifo_ref", "fifo_meta",
                                  "bad_timeout", "json_exists"])
def test_bad_input_gets_one_clear_line(tmp_path, case):
    meta = write_meta(tmp_path, ["audio=0.2"])
    args = ["--url", "http://127.0.0.1:9", "--meta", str(meta)]
    expect = {
        "no_meta": "cannot read", "bad_line": ":1: expected utt_id|prompt_text|prompt_wav|target_text",
        "pcm_no_rate": "--response-format pcm has no header: give --sample-rate",
        "bad_levels": "--concurrency wants comma-separated integers", "no_ref": "cannot read reference audio",
        "bad_url": "--url must start with http:// or https://",
        "two_asr": "give --whisper or --transcriber, not both",
        "reference_without_plot": "--reference draws into the plot: give --plot OUT.png too",
        "plot_folder": "does not exist",
        "bad_port": "--url 'http://127.0.0.1:abc': Port could not be cast to integer value",
        "no_host": "--url 'http://:8000' names no host",
        "json_folder": f"--json {tmp_path / 'no' / 'out.json'}: folder {tmp_path / 'no'} does not exist",
        "meta_not_utf8": "not UTF-8 text (byte 0xff at offset 5); save the meta list as UTF-8",
        "huge_ref": "ref0.wav: 33.0 MiB, over the 32.0 MiB limit for a reference audio",
        "fifo_ref": "ref0.wav: not a regular file (a FIFO); a reference audio must be one",
        "fifo_meta": "meta.lst: not a regular file (a FIFO); a meta list must be one",
        "bad_timeout": "--timeout must be a number of seconds above 0, got 0",
        "json_exists": f"--json {tmp_path / 'old.json'} exists; pass --force to overwrite it",
    }[case]
    if case == "no_meta":
        args[3] = str(tmp_path / "missing.lst")
    elif case == "bad_line":
        meta.write_text("utt0|only two\n")
    elif case == "pcm_no_rate":
        args += ["--response-format", "pcm"]
    elif case == "bad_levels":
        args += ["--concurrency", "1,x"]
    elif case == "no_ref":
        (tmp_path / "wavs" / "ref0.wav").unlink()
    elif case == "two_asr":
        args += ["--whisper", str(tmp_path), "--transcriber", "a:b"]
    elif case == "reference_without_plot":
        args += ["--reference", "port"]
    elif case == "plot_folder":
        args += ["--plot", str(tmp_path / "no" / "such" / "out.png")]
    elif case == "bad_port":
        args[1] = "http://127.0.0.1:abc"
    elif case == "no_host":
        args[1] = "http://:8000"
    elif case == "json_folder":
        args += ["--json", str(tmp_path / "no" / "out.json")]
    elif case == "meta_not_utf8":
        meta.write_bytes(b"utt0|\xff|wavs/ref0.wav|text\n")
    elif case == "huge_ref":
        with open(tmp_path / "wavs" / "ref0.wav", "r+b") as fh:
            fh.truncate(33 * 1024 * 1024)  # sparse: the size alone must refuse it, nothing is read
    elif case in ("fifo_ref", "fifo_meta"):
        target = tmp_path / "wavs" / "ref0.wav" if case == "fifo_ref" else meta
        target.unlink()
        os.mkfifo(target)  # nobody writes: an open() that blocks would hang the command
    elif case == "bad_timeout":
        args += ["--timeout", "0"]
    elif case == "json_exists":
        (tmp_path / "old.json").write_text("{}")
        args += ["--json", str(tmp_path / "old.json")]
    else:
        args[1] = "127.0.0.1:9"
    r = _cli(*args, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("drama3-patches bench: ") and expect in lines[0], r.stderr


MISBEHAVING = {
    "badjson": "bad SSE data: '{not json'",
    "notobject": "bad SSE data: a JSON list, not an object: '[1, 2]'",
    "numaudio": "bad SSE data: speech.audio.delta whose audio is int, not base64 text",
    "strerror": "server error: overloaded",
    "zerobits": "bad audio: WAV fmt chunk says 1 channel(s), 16000 Hz, 0 bits per sample",
    "shortfmt": "bad audio: WAV fmt chunk of 8 bytes (16 at least)",
    "hugeline": f"ValueError: SSE line over {sb.MAX_EVENT_BYTES} bytes",
}


def test_a_misbehaving_server_fails_its_requests_and_keeps_the_others(tmp_path):
    """Each malformed answer is that request's failure, with the cause; the run goes on, every
    completed result is kept, and the huge line is refused at the line limit."""
    modes = list(MISBEHAVING)
    meta = write_meta(tmp_path, ["audio=1.0", *(f"mode={m}" for m in modes), "audio=0.5"])
    out = tmp_path / "out.json"
    with SpeechServer() as server:
        r = bench(server, meta, "--concurrency", "3", "--limit", str(len(modes) + 2), "--warmup", "0",
                  "--json", str(out), timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    (level,) = json.loads(out.read_text())["levels"]
    assert (level["completed"], level["failed"]) == (2, len(modes))
    assert level["audio_seconds"] == pytest.approx(1.5)
    errors = {f["utt"]: f["error"] for f in level["failures"]}
    assert errors == {f"utt{i + 1}": MISBEHAVING[m] for i, m in enumerate(modes)}


def test_the_deadline_ends_a_trickling_request(tmp_path):
    """A server that sends a byte every 0.05 s never trips a socket timeout; the request still ends
    at --timeout (the bound below is loose: the server would trickle for 30 s)."""
    meta = write_meta(tmp_path, ["mode=trickle", "audio=0.5"])
    out = tmp_path / "out.json"
    with SpeechServer() as server:
        r = bench(server, meta, "--concurrency", "2", "--limit", "2", "--warmup", "0", "--timeout", "1",
                  "--json", str(out), timeout=120)
    assert r.returncode == 1, r.stderr
    (level,) = json.loads(out.read_text())["levels"]
    reqs = {x["utt"]: x for x in level["requests"]}
    assert reqs["utt0"]["error"] == "deadline: no complete response within --timeout 1 s"
    assert 1.0 <= reqs["utt0"]["latency"] < 10.0
    assert reqs["utt1"]["success"] and level["completed"] == 1


def test_a_line_over_the_limit_is_not_read_whole(tmp_path, monkeypatch):
    """The SSE line limit bounds what the reader takes in, not a check after reading it all: an
    8 MiB line against a 1 MiB limit never has 8 MiB in memory (traced allocations)."""
    import tracemalloc

    monkeypatch.setattr(sb, "MAX_EVENT_BYTES", 1024 * 1024)
    (tmp_path / "r.wav").write_bytes(ref_wav(1))
    line = sb.MetaLine("u", "p", str(tmp_path / "r.wav"), "mode=hugeline huge=8388608")
    with SpeechServer() as server:
        tracemalloc.start()
        try:
            res = sb.speak(line, sb.Settings(url=server.url, timeout=60))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert not res.ok and res.error == "ValueError: SSE line over 1048576 bytes"
    assert peak < 4 * 1024 * 1024, peak


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for n in (1, 2, 7, 64):
        values = [rng.random() * 10 for _ in range(n)]
        for q in (50, 99):
            assert sb.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert sb.percentile([], 50) is None


def test_wav_header_parsing():
    head = wav_header(44100, channels=2)
    assert sb.parse_wav_header(head[:30]) is None  # incomplete: wait for more bytes
    assert sb.parse_wav_header(head) == (44100, 2, 16, 44)
    with pytest.raises(ValueError):
        sb.parse_wav_header(b"ID3\x04" + b"\0" * 40)
    # A header split across deltas, then samples: only sample bytes count, stamped on arrival.
    c = sb.AudioCounter("wav", None)
    c.feed(head[:20], 1.0)
    c.feed(head[20:] + b"\0" * 8, 2.0)
    c.feed(b"\0" * 4, 3.0)
    assert (c.first_audio, c.sample_bytes, c.seconds) == (2.0, 12, 12 / (44100 * 2 * 2))


# ---------------------------------------------------------------- WER against jiwer

# (reference, transcript, reference and transcript after each normalizer). Written out by hand:
# seed-tts-eval drops punctuation but the apostrophe and lower-cases; Whisper's normalizer also
# spells numbers as digits, expands contractions, drops fillers and americanizes spellings.
PAIRS = [
    ("Hello, World! How are you?", "hello world how are you",
     "hello world how are you", "hello world how are you",
     "hello world how are you", "hello world how are you"),
    ("It's twenty five past nine.", "It is 25 past 9", "it's twenty five past nine", "it is 25 past 9",
     "it is 25 past 9", "it is 25 past 9"),
    ("I can't go, Mr. Smith.", "I cannot go mister smith", "i can't go mr smith", "i cannot go mister smith",
     "i can not go mister smith", "i cannot go mister smith"),
    ("The colour of the sea.", "um the color of sea", "the colour of the sea", "um the color of sea",
     "the color of the sea", "the color of sea"),
    # Typographic marks: seed-tts-eval removes the hyphen (joining the words); Whisper's normalizer
    # keeps periods for decimals, so the ellipsis leaves a ".." word that counts as a deletion.
    ("Well-known “quotes” — here…", "well known quotes here", "wellknown quotes here",
     "well known quotes here", "well known quotes here ..", "well known quotes here"),
]


@pytest.mark.parametrize("method", ["seed-tts-eval", "whisper"])
def test_wer_matches_jiwer_on_known_transcript_pairs(method):
    jiwer = pytest.importorskip("jiwer")
    if method == "whisper":
        pytest.importorskip("whisper_normalizer")
    col = 2 if method == "seed-tts-eval" else 4
    refs = [p[col] for p in PAIRS]
    hyps = [p[col + 1] for p in PAIRS]
    got = wer.score([(f"u{i}", p[0], p[1]) for i, p in enumerate(PAIRS)], method)
    assert [u.reference_normalized for u in got.utterances] == refs
    assert [u.hypothesis_normalized for u in got.utterances] == hyps
    # jiwer's own numbers from the normalized strings: per utterance, and over the corpus.
    for u, r, h in zip(got.utterances, refs, hyps):
        one = jiwer.process_words(r, h)
        assert (u.hits, u.substitutions, u.deletions, u.insertions) == (one.hits, one.substitutions, one.deletions,
                                                                        one.insertions)
        assert u.wer == pytest.approx(jiwer.wer(r, h))
    assert got.corpus == pytest.approx(jiwer.wer(refs, hyps))
    assert got.utterance_mean == pytest.approx(sum(jiwer.wer(r, h) for r, h in zip(refs, hyps)) / len(refs))
    fields = got.fields()
    assert fields["wer"] == (got.utterance_mean if method == "seed-tts-eval" else got.corpus)
    corpus = jiwer.process_words(refs, hyps)
    assert (fields["wer_hits"], fields["wer_substitutions"], fields["wer_deletions"], fields["wer_insertions"]) == (
        corpus.hits, corpus.substitutions, corpus.deletions, corpus.insertions)


def test_wer_by_hand():
    """Small enough to count: the cat sat on the mat / the cat sit on mat: 1 substitution, 1 deletion."""
    got = wer.score([("a", "The cat sat on the mat.", "the cat sit on mat"), ("b", "Hello!", "hello there")])
    a, b = got.utterances
    assert (a.hits, a.substitutions, a.deletions, a.insertions, a.reference_words) == (4, 1, 1, 0, 6)
    assert (b.hits, b.substitutions, b.deletions, b.insertions, b.reference_words) == (1, 0, 0, 1, 1)
    assert got.corpus == pytest.approx(3 / 7)  # (2 + 1) errors over 6 + 1 words
    assert got.utterance_mean == pytest.approx((2 / 6 + 1 / 1) / 2)
    assert got.value == got.utterance_mean  # Seed-TTS-Eval averages its utterances
    # Numbers: spelled out and in digits are two words against one for seed-tts-eval, equal for whisper.
    assert wer.score([("n", "twenty five", "25")], "seed-tts-eval").value == pytest.approx(1.0)
    pytest.importorskip("whisper_normalizer")
    assert wer.score([("n", "twenty five", "25")], "whisper").value == 0.0


def test_an_empty_reference_is_skipped_with_its_reason():
    got = wer.score([("a", "?!", "something"), ("b", "yes", "")])
    assert got.skipped == [{"utt": "a", "reason": "reference is empty after seed-tts-eval normalization"}]
    (b,) = got.utterances
    assert (b.deletions, b.wer) == (1, 1.0)
    nothing = wer.score([("a", "...", "x")])
    assert nothing.value is None and nothing.corpus is None and len(nothing.skipped) == 1


def test_transcribers_load_from_local_paths_only(tmp_path):
    assert wer.unavailable("seed-tts-eval", None, None) == "no --whisper model path given"
    assert wer.unavailable("seed-tts-eval", str(tmp_path / "x"), None) == (
        f"{tmp_path / 'x'} does not exist (models are never downloaded)")
    assert wer.unavailable("whisper", None, "m:f") is None
    with pytest.raises(ValueError, match="does not exist"):
        wer.load_transcriber(str(tmp_path / "x"))
    with pytest.raises(ValueError, match=r"no config\.json"):
        wer.load_transcriber(str(tmp_path))
    with pytest.raises(ValueError, match="openai-whisper loads a .pt checkpoint file, not a folder"):
        wer.load_transcriber(str(tmp_path), backend="openai-whisper")
    ckpt = tmp_path / "large-v3.pt"
    ckpt.write_bytes(b"")
    if importlib.util.find_spec("whisper") is None:
        with pytest.raises(ValueError, match=r"openai-whisper is not installed \(pip install openai-whisper\)"):
            wer.load_transcriber(str(ckpt))
    fn, what = wer.load_transcriber(transcriber="support.speech_server:transcribe")
    assert fn is transcribe and what == "support.speech_server:transcribe (plug-in)"
    for spec, msg in (("nocolon", "expected MODULE:FUNCTION"), ("no_such_mod_xyz:f", "cannot import no_such_mod_xyz"),
                      ("support.speech_server:NATIVE_RATE", "is not callable")):
        with pytest.raises(ValueError, match=msg):
            ba.import_callable(spec)


def test_wer_and_sim_end_to_end_through_plug_ins(tmp_path):
    """The server's audio says the words (or the `heard=` misrecognition); the bench scores what came back."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("jiwer")
    texts = ["The cat sat.", "Hello, world!", "It's twenty five past.", "A failed one."]
    prompts = ["audio=0.5 chunks=2", "audio=0.75", "audio=1.0 heard=its_twenty_five_pass", "audio=0.3 mode=error"]
    meta = write_meta(tmp_path, texts, prompts)
    out = tmp_path / "out.json"
    with SpeechServer() as server:
        r = bench(server, meta, "--concurrency", "2", "--limit", "4", "--warmup", "0", "--json", str(out),
                  "--transcriber", "support.speech_server:transcribe", "--sim-embedder", "support.speech_server:embed")
    assert r.returncode == 1, r.stderr  # the failed stream
    (level,) = json.loads(out.read_text())["levels"]
    said = {u["utt"]: u["hypothesis"] for u in level["wer_utterances"]}
    assert said == {"utt0": "The cat sat.", "utt1": "Hello, world!", "utt2": "its twenty five pass"}  # not utt3
    expected = wer.score([(u, texts[int(u[3:])], h) for u, h in said.items()])
    assert level["wer"] == pytest.approx(expected.value) and level["wer"] == pytest.approx((0 + 0 + 2 / 4) / 3)
    assert level["wer_method"] == "seed-tts-eval" and level["wer_corpus"] == pytest.approx(2 / 9)
    # SIM: cosine between the embedding of each stream's samples and of its prompt wav.
    seconds = {"utt0": 0.5, "utt1": 0.75, "utt2": 1.0}
    words = {"utt0": "The cat sat.", "utt1": "Hello, world!", "utt2": "its twenty five pass"}
    sims = {u["utt"]: u["sim"] for u in level["sim_utterances"]}
    assert set(sims) == set(seconds)
    for utt, secs in seconds.items():
        samples = spoken_bytes(words[utt], int(round(secs * NATIVE_RATE)) * 2)
        gen = np.frombuffer(samples, dtype="<i2") / 32768.0
        i = int(utt[3:])
        prompt = np.array([i, i]) / 32768.0
        a, b = embed(gen), embed(prompt)
        assert sims[utt] == pytest.approx(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)))
    assert level["sim"] == pytest.approx(sum(sims.values()) / 3)
    row = r.stdout.splitlines()[2]
    assert row.endswith(f"| {level['wer'] * 100:.2f}% | {level['sim']:.3f} | 3 | 1 |"), r.stdout
    assert re.search(r"concurrency 2 scoring: 3/3 done, 3 completed, 0 failed", r.stderr), r.stderr


def test_scoring_reports_each_clip_it_cannot_score(tmp_path):
    pytest.importorskip("numpy")
    pytest.importorskip("jiwer")
    (tmp_path / "r.wav").write_bytes(ref_wav(3))
    lines = {"a": sb.MetaLine("a", "p", str(tmp_path / "missing.wav"), "hello"),
             "b": sb.MetaLine("b", "p", str(tmp_path / "r.wav"), "hi"),
             "c": sb.MetaLine("c", "p", str(tmp_path / "r.wav"), "fine")}
    done = {"ok": True, "sample_rate": 16000, "ttfa": 0.1, "elapsed": 0.2, "audio_s": 0.1}
    level = sb.Level(1, [sb.Result("a", audio=spoken_bytes("hello", 3200), **done),
                         sb.Result("b", bits=32, audio=b"\0" * 6400, **done),
                         sb.Result("c", audio=spoken_bytes("fine", 3200), **done),
                         sb.Result("d", ok=False, error="HTTP 500")], 1.0)
    sb.score_level(level, lines, transcribe, sim.Scorer(embed))
    assert [(u.utt, u.hypothesis) for u in level.wer.utterances] == [("a", "hello"), ("c", "fine")]
    assert level.wer.skipped == [{"utt": "b", "reason": "32-bit samples: only 16-bit PCM is scored"}]
    assert [u["utt"] for u in level.sim.utterances] == ["c"]
    reasons = {x["utt"]: x["reason"] for x in level.sim.skipped}
    assert set(reasons) == {"a", "b"} and reasons["a"].startswith("FileNotFoundError")
    result = level.result()
    assert (result["wer"], result["wer_scored"], result["sim_scored"]) == (0.0, 2, 1)


def test_whisper_method_from_the_command_line(tmp_path):
    pytest.importorskip("whisper_normalizer")
    meta = write_meta(tmp_path, ["It's twenty five past."], ["audio=0.5 heard=it_is_25_past"])
    out = tmp_path / "out.json"
    with SpeechServer() as server:
        r = bench(server, meta, "--concurrency", "1", "--limit", "1", "--warmup", "0", "--json", str(out),
                  "--transcriber", "support.speech_server:transcribe", "--wer-method", "whisper")
    assert r.returncode == 0, r.stderr
    (level,) = json.loads(out.read_text())["levels"]
    (u,) = level["wer_utterances"]
    assert (u["reference_normalized"], u["hypothesis_normalized"], level["wer"]) == ("it is 25 past", "it is 25 past",
                                                                                    0.0)


def _tiny_whisper(folder: Path):
    """A random two-layer Whisper with a byte-level tokenizer and Whisper's special tokens, saved as a hub folder."""
    tf = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    folder.mkdir()
    chars = bytes_to_unicode()
    (folder / "vocab.json").write_text(json.dumps({chars[b]: b for b in range(256)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    end = "<|endoftext|>"
    tok = tf.WhisperTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), unk_token=end, bos_token=end,
                              eos_token=end, pad_token=end)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>", "<|notimestamps|>"]})
    ids = {t: tok.convert_tokens_to_ids(t) for t in (end, "<|startoftranscript|>", "<|en|>", "<|translate|>",
                                                     "<|transcribe|>", "<|notimestamps|>")}
    torch.manual_seed(0)
    model = tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=len(tok), num_mel_bins=80, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=1500,
        max_target_positions=64, decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=ids[end],
        pad_token_id=ids[end], bos_token_id=ids[end]))
    model.generation_config = tf.GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=ids[end], pad_token_id=ids[end],
        max_length=12, is_multilingual=True, lang_to_id={"<|en|>": ids["<|en|>"]},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"],
        # Random weights: keep the special tokens out of the text so that it decodes to something.
        suppress_tokens=[i for t, i in ids.items() if t != end], begin_suppress_tokens=[ids[end]])
    model.save_pretrained(folder)
    processor = tf.WhisperProcessor(feature_extractor=tf.WhisperFeatureExtractor(feature_size=80), tokenizer=tok)
    processor.save_pretrained(folder)
    return model.eval(), processor


def test_whisper_through_a_local_transformers_folder(tmp_path, monkeypatch):
    """The transformers path on a tiny random Whisper saved to disk: loaded offline, English transcription forced."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    model, processor = _tiny_whisper(tmp_path / "whisper")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    fn, what = wer.load_transcriber(str(tmp_path / "whisper"))
    assert what == f"transformers Whisper {tmp_path / 'whisper'}"
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["TRANSFORMERS_OFFLINE"] == "1"
    clip = np.sin(2 * np.pi * 300 * np.arange(16000) / 16000).astype(np.float32)
    feats = processor(clip, sampling_rate=16000, return_tensors="pt").input_features
    with torch.no_grad():
        out = model.generate(feats, language="english", task="transcribe")
    text = processor.batch_decode(out, skip_special_tokens=True)[0]
    assert text and fn(clip) == text  # the folder on disk, loaded offline, is the model that was saved


def test_sim_through_a_local_transformers_wavlm_xvector(tmp_path, monkeypatch):
    """The transformers path end to end on a tiny random WavLMForXVector saved to disk (no hub)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.WavLMConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
                         num_conv_pos_embedding_groups=2, tdnn_dim=(16, 16, 16, 16, 48), tdnn_kernel=(5, 3, 3, 1, 1),
                         tdnn_dilation=(1, 2, 3, 1, 1), xvector_output_dim=8, num_buckets=32, max_bucket_distance=64)
    model = tf.WavLMForXVector(cfg).eval()
    model.save_pretrained(tmp_path / "sv")
    fe = tf.Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                                     return_attention_mask=True)
    fe.save_pretrained(tmp_path / "sv")
    embed_fn, what = sim.load_embedder(str(tmp_path / "sv"))
    assert "not comparable" in what
    t = np.arange(16000) / 16000
    a, b = np.sin(2 * np.pi * 220 * t).astype(np.float32), np.sign(np.sin(2 * np.pi * 97 * t)).astype(np.float32)
    with torch.no_grad():
        want = [model(**fe(x, sampling_rate=16000, return_tensors="pt")).embeddings[0].numpy() for x in (a, b)]
    (tmp_path / "p.wav").write_bytes(wav_header(16000)[:-4] + struct.pack("<I", 32000)
                                     + (np.round(b * 32767)).astype("<i2").tobytes())
    got = sim.Scorer(embed_fn).score([("u", a, str(tmp_path / "p.wav"))])
    (u,) = got.utterances
    # The prompt went through the wav file: 16-bit rounding moves the embedding a little.
    assert u["sim"] == pytest.approx(sim.cosine(*want), abs=1e-4)
    assert abs(u["sim"]) < 0.999  # two different clips


# ---------------------------------------------------------------- audio plumbing


def test_resample_and_pcm_conversion():
    np = pytest.importorskip("numpy")
    rate, new = 24000, 16000
    t = np.arange(rate) / rate
    tone = np.sin(2 * np.pi * 440 * t)
    out = ba.resample(tone, rate, new)
    assert len(out) == new
    want = np.sin(2 * np.pi * 440 * np.arange(new) / new)
    assert np.max(np.abs(out - want)) < 1e-3  # a whole number of periods: FFT resampling is exact
    assert ba.resample(tone[:100], rate, rate).tolist() == pytest.approx(tone[:100].tolist(), abs=1e-7)
    stereo = struct.pack("<4h", 32767 // 2 * 2, 0, -32768, -32768)
    assert ba.pcm16_to_float(stereo, channels=2).tolist() == pytest.approx([(32766 / 32768) / 2, -1.0])


@pytest.mark.parametrize("n", [7, 8, 1000, 1001, 24000, 24001])
@pytest.mark.parametrize("rate", [8000, 22050, 24000, 44100, 48000])
def test_resample_is_scipy_signal_resample(n, rate):
    """Seed-TTS-Eval resamples with scipy.signal.resample before Whisper; ours is the same FFT
    method in numpy (odd and even lengths, up and down, the Nyquist bin of each)."""
    np = pytest.importorskip("numpy")
    signal = pytest.importorskip("scipy.signal")
    x = np.random.default_rng(n + rate).standard_normal(n).astype(np.float32)
    want = signal.resample(x.astype(np.float64), int(n * 16000 / rate))
    got = ba.resample(x, rate)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.max(np.abs(got - want), initial=0.0) < 1e-5


def test_read_wav_gives_mono_float_and_rate(tmp_path):
    (tmp_path / "r.wav").write_bytes(ref_wav(7))
    audio, rate = ba.read_wav(str(tmp_path / "r.wav"))
    assert rate == 16000 and audio.tolist() == [7 / 32768, 7 / 32768]
    (tmp_path / "bad.wav").write_bytes(b"not a wav at all")
    if importlib.util.find_spec("soundfile") is None:
        with pytest.raises(ValueError, match="install soundfile"):
            ba.read_wav(str(tmp_path / "bad.wav"))


# ---------------------------------------------------------------- progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_uses_tqdm_on_a_terminal_and_plain_lines_elsewhere():
    assert progress.use_tqdm(io.StringIO()) is False
    has_tqdm = importlib.util.find_spec("tqdm") is not None
    assert progress.use_tqdm(Terminal()) is has_tqdm
    if not has_tqdm:
        pytest.skip("tqdm is not installed")
    term = Terminal()
    p = progress.make(term, 3, "concurrency 2")
    assert p.bar is not None
    p.start()
    for ok in (True, False, True):
        p.tick(ok)
    text = term.getvalue()
    assert "\r" in text and "concurrency 2" in text and "3/3" in text and "completed=2" in text \
        and "failed=1" in text, text
    plain = io.StringIO()
    ticks = iter([0.0, 0.0, 0.5, 1.0, 12.0, 12.5])
    p = progress.Progress(plain, 16, "c", clock=lambda: next(ticks))
    p.start()
    p.tick(True)  # 1/16 at 0.5 s: not a line (every 2nd of 16, or 10 s)
    p.tick(False)  # 2/16 at 1.0 s: a line
    p.tick(True)  # 3/16 at 12 s: a line, 11 s since the last
    assert plain.getvalue().splitlines() == ["c: 2/16 done, 1 completed, 1 failed, 1.0 s elapsed",
                                             "c: 3/16 done, 2 completed, 1 failed, 12.0 s elapsed"]


def test_progress_on_a_real_terminal_needs_its_size():
    """A pty that reports no size gets plain lines (tqdm would draw nothing there); a sized one, the bar."""
    if importlib.util.find_spec("tqdm") is None or not hasattr(os, "openpty"):
        pytest.skip("needs tqdm and a pty")
    import fcntl
    import termios

    leader, follower = os.openpty()
    try:
        with open(follower, "w", closefd=False) as tty:
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
            assert tty.isatty() and progress.use_tqdm(tty) is False
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
            assert progress.use_tqdm(tty) is True
    finally:
        os.close(leader)
        os.close(follower)


def test_quiet_silences_progress(tmp_path):
    meta = write_meta(tmp_path, ["audio=0.2", "audio=0.2 mode=http500"])
    with SpeechServer() as server:
        r = bench(server, meta, "--concurrency", "1,2", "--limit", "2", "--warmup", "0", "--quiet")
    assert r.returncode == 1
    assert r.stdout.splitlines()[0] == HEADER
    # Only the failures (results, not progress) remain on stderr.
    assert r.stderr.splitlines() == ["  failed: utt1: HTTP 500: {\"error\": \"boom\"}"] * 2, r.stderr


# ---------------------------------------------------------------- plot


def _published_table() -> list[dict]:
    """The port's table as docs/recipe.md prints it."""
    text = (ROOT / "docs" / "recipe.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) s \| ([\d.]+) s \| ([\d.]+) \| ([\d.]+)% \|$", text, re.M)
    assert rows, "no port table in docs/recipe.md"
    return [{"max_concurrency": int(c), "audio_throughput": float(a), "median_ttft_ms": float(p50) * 1000,
             "p99_ttft_ms": float(p99) * 1000, "mean_rtf": float(rtf), "wer": float(w) / 100}
            for c, a, p50, p99, rtf, w in rows]


def test_port_reference_is_the_published_table():
    assert plot.PORT_REFERENCE["levels"] == [pytest.approx(row) for row in _published_table()]


def _levels():
    return [{"max_concurrency": 1, "audio_throughput": 0.5, "median_ttft_ms": 1000.0, "p99_ttft_ms": 1500.0},
            {"max_concurrency": 4, "audio_throughput": 1.8, "median_ttft_ms": 1200.0, "p99_ttft_ms": 2500.0},
            {"max_concurrency": 8, "audio_throughput": None, "median_ttft_ms": None, "p99_ttft_ms": None}]


def test_plot_figure_has_the_run_and_reference_series():
    pytest.importorskip("matplotlib")
    fig = plot.build_figure(_levels(), plot.PORT_REFERENCE, "t")
    thr, lat = fig.axes  # levels without chunk arrivals: the two summary panels only
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ax in (thr, lat)
             for ln in ax.get_lines()}
    ref = plot.PORT_REFERENCE["label"]
    cs = [1, 16, 32, 64]
    assert lines == {
        "this run: audio s/s": ([1, 4], [0.5, 1.8]),  # the all-failed level has no point
        "this run: TTFA p50": ([1, 4], [1.0, 1.2]),
        "this run: TTFA p99": ([1, 4], [1.5, 2.5]),
        f"{ref}: audio s/s": (cs, [0.569, 3.19, 4.68, 7.20]),
        f"{ref}: TTFA p50": (cs, pytest.approx([1.26, 4.14, 5.77, 14.0])),
        f"{ref}: TTFA p99": (cs, pytest.approx([1.47, 26.5, 7.83, 14.7])),
    }
    assert [ln.get_label() for ln in thr.get_legend().get_lines()] == ["this run: audio s/s", f"{ref}: audio s/s"]
    assert [int(t) for t in lat.get_xticks()] == [1, 4, 8, 16, 32, 64]
    assert lat.get_yscale() == "log"  # 1 s beside 26.5 s
    # A reference that does not publish a figure is not drawn for it, and the title says so.
    partial = {"label": "partial", "levels": [{"max_concurrency": 2, "audio_throughput": 1.0}]}
    fig = plot.build_figure(_levels(), partial)
    labels = [ln.get_label() for ax in fig.axes for ln in ax.get_lines()]
    assert "partial: audio s/s" in labels and not any(x.startswith("partial: TTFA") for x in labels)
    assert "partial: no TTFA p50; partial: no TTFA p99" in fig.get_suptitle()
    assert plot.build_figure(_levels()).axes[1].get_yscale() == "linear"


def _playout_level(c, streams):
    """A level whose requests carry chunk timelines (``streams``: name -> chunks)."""
    from drama3_patches.tools.bench import playout

    reqs = [{"utt": name, "success": True, "audio_seconds": sum(s for _, s in chunks),
             **playout.request_figures(chunks, chunks[0][0])} for name, chunks in streams.items()]
    return {"max_concurrency": c, "audio_throughput": 1.0, "median_ttft_ms": 100.0, "p99_ttft_ms": 200.0,
            "requests": reqs, "playout": playout.level_figures([r | {"audio_s": r["audio_seconds"]} for r in reqs])}


def test_plot_draws_the_cushion_cdf_and_the_p50_p90_worst_streams():
    pytest.importorskip("matplotlib")
    quarter = {f"s{k}": [(0.1 + k * 0.01 + 0.5 * i * k / 3, 0.25) for i in range(4)] for k in range(4)}
    # chunks every k/6 s: D of s0..s3 0, 0 (early), 3 x (1/3 - 1/4) = 0.25 in three stalls, 0.75
    levels = [_playout_level(1, quarter), _playout_level(2, {"a": [(0.2, 0.1), (0.5, 0.1)], "b": [(0.3, 1.0)]})]
    fig = plot.build_figure(levels)
    assert len(fig.axes) == 5  # throughput, TTFA, CDF of D, one timeline per level
    cdf = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[2].get_lines()}
    assert cdf == {"concurrency 1 (4 streams)": ([0.0, 0.0, 0.0, pytest.approx(0.25), pytest.approx(0.75)],
                                                 [0.0, 0.25, 0.5, 0.75, 1.0]),
                   "concurrency 2 (1 streams)": ([0.0, pytest.approx(0.2)], [0.0, 1.0])}
    c1 = fig.axes[3]
    labels = [ln.get_label() for ln in c1.get_lines()]
    # nearest rank of 4 streams by D: p50 index 2 (s2), p90 and worst index 3 (s3)
    assert labels == ["p50 s2: D 0.25 s, 3 stall(s)", "_child1", "p90/worst s3: D 0.75 s, 3 stall(s)", "_child3"]
    received, played = c1.get_lines()[2:4]
    assert list(received.get_xdata()) == pytest.approx([0.0, 0.13, 0.63, 1.13, 1.63])
    assert list(received.get_ydata()) == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert list(played.get_xdata()) == pytest.approx([0.13, 0.38, 0.63, 0.88, 1.13, 1.38, 1.63, 1.88])
    assert list(played.get_ydata()) == pytest.approx([0.0, 0.25, 0.25, 0.5, 0.5, 0.75, 0.75, 1.0])
    # the single-chunk stream of level 2 is not drawn; its one stream is p50, p90 and worst at once
    assert [ln.get_label() for ln in fig.axes[4].get_lines()][0] == "p50/p90/worst a: D 0.20 s, 1 stall(s)"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "b.png"
    plot.write_png(str(out), _levels(), plot.PORT_REFERENCE, "t")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1100, 460)
    assert data[-8:-4] == b"IEND"


def test_bench_plot_from_the_command_line(tmp_path):
    pytest.importorskip("matplotlib")
    meta = write_meta(tmp_path, ["audio=0.3 first=0.05", "audio=0.4 first=0.1"])
    out = tmp_path / "b.png"
    with SpeechServer() as server:
        r = bench(server, meta, "--concurrency", "1,2", "--limit", "2", "--warmup", "0", "--plot", str(out),
                  "--reference", "port", "--quiet")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert r.stderr == ""


def test_unreachable_server_counts_every_request_as_failed(tmp_path):
    import socket

    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    meta = write_meta(tmp_path, ["audio=0.2", "audio=0.3"])
    out = tmp_path / "out.json"
    r = _cli("--url", f"http://127.0.0.1:{port}", "--meta", str(meta), "--concurrency", "2", "--limit", "2",
             "--warmup", "1", "--json", str(out), timeout=60)
    assert r.returncode == 1
    (level,) = json.loads(out.read_text())["levels"]
    assert (level["completed"], level["failed"]) == (0, 2)
    assert all(f["error"].startswith("ConnectionRefusedError") for f in level["failures"])
    assert level["audio_throughput"] == 0 and level["median_ttft_ms"] is None and level["mean_ttft_ms"] is None
    assert r.stdout.splitlines()[2] == "| 2 | 0.00 | - | - | - | - | - | - | - | - | 0 | 2 |"
    assert "no completed stream" not in r.stdout  # no scorer asked for: the reason is the missing model


def test_the_deadline_ends_a_trickling_http10_response(tmp_path):
    """An HTTP/1.0 server (the response owns the socket once headers are read, so the connection
    object no longer holds it) that sends an SSE comment every second for 30 s: the request still
    ends at --timeout 2, with the deadline as its error. The bound is loose on purpose: it only
    needs to be well under the 30 s the server would go on for."""
    import http.server
    import threading
    import time

    stop = threading.Event()

    class Trickle(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(30):
                if stop.is_set():
                    return
                try:
                    self.wfile.write(b": still here\n\n")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(1.0)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "ref.wav").write_bytes(ref_wav(1))
    line = sb.MetaLine("u", "prompt", str(tmp_path / "ref.wav"), "text")
    try:
        start = time.monotonic()
        res = sb.speak(line, sb.Settings(url=f"http://127.0.0.1:{server.server_address[1]}", timeout=2))
        took = time.monotonic() - start
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
    assert not res.ok and res.error == "deadline: no complete response within --timeout 2 s"
    assert 2.0 <= took < 20.0


@pytest.mark.forked
def test_a_request_that_begins_after_ctrl_c_is_cut_and_the_next_level_streams(tmp_path):
    """A worker that took its line before the Ctrl-C but reaches its deadline after ``expire_all``
    (still building the body) fails with the deadline's error and never reaches the server (which
    would trickle for 5 s and end it as a truncated stream); a level started afterwards streams."""
    (tmp_path / "ref.wav").write_bytes(ref_wav(1))
    trickles = sb.MetaLine("u", "mode=trickle trickle=5", str(tmp_path / "ref.wav"), "text")
    speaks = sb.MetaLine("v", "audio=0.25", str(tmp_path / "ref.wav"), "text")
    settings = sb.Settings(url="", timeout=60)
    with SpeechServer() as server:
        settings.url = server.url
        sb.expire_all()  # the Ctrl-C, with no request in flight yet
        res = sb.speak(trickles, settings)
        received = len(server.requests)
        level = sb.run_level([speaks], 1, settings)
    assert not res.ok and res.error == "deadline: no complete response within --timeout 60 s", res.error
    assert received == 0
    assert [(r.utt, r.ok, r.error) for r in level.results] == [("v", True, "")]


def test_ctrl_c_keeps_the_completed_levels_and_cuts_the_requests_in_flight(tmp_path):
    """SIGINT while the second level's request trickles (it would for 30 s): exit 130, the first
    level's figures are in the table and the JSON with a note saying what was left out, and the
    request in flight is cut rather than waited for (the bound is loose: far under 30 s)."""
    import signal
    import subprocess
    import sys
    import time

    from support.subproc import child_env

    meta = write_meta(tmp_path, ["audio=0.5"])
    out = tmp_path / "out.json"
    with SpeechServer() as server:
        server.trickle_after = 1
        argv = ["bench", "--url", server.url, "--meta", str(meta), "--concurrency", "1,2", "--limit", "1",
                "--warmup", "0", "--json", str(out), "--quiet"]
        # bench as a terminal's shell starts it: Ctrl-C raises KeyboardInterrupt. A child inherits
        # SIGINT ignored when the suite runs as a background job of a non-interactive shell
        # (`cmd &`), and Python keeps it ignored: bench would never see this test's SIGINT.
        proc = subprocess.Popen(
            [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "from drama3_patches.tools import main; sys.exit(main(sys.argv[1:]))", *argv],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(None, [TESTS]))
        try:
            # the signal goes once the second level's request is in flight: the server has begun its trickle
            deadline = time.monotonic() + 120
            while not server.trickling.wait(0.05) and time.monotonic() < deadline and proc.poll() is None:
                pass
            assert server.trickling.is_set() and len(server.requests) == 2, proc.communicate(timeout=5)
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=60)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    note = "interrupted (Ctrl-C): 1 of 2 concurrency level(s) completed and are kept; [2] not measured"
    assert f"drama3-patches bench: {note}" in stderr
    assert HEADER in stdout and stdout.count("\n| 1 |") == 1 and "\n| 2 |" not in stdout
    doc = json.loads(out.read_text())
    assert doc["interrupted"] == note
    (level,) = doc["levels"]
    assert (level["max_concurrency"], level["completed"], level["failed"]) == (1, 1, 0)
    assert took < 15.0


# ---------------------------------------------------------------- playout against injected gaps

# (spec words, injected chunk times after the first audio, chunk seconds, D, stalls, longest stall)
PLAYOUT_STREAMS = [
    ("pieces=0.25,0.25,0.25,0.25 gaps=0.5", [0.0, 0.5, 1.0, 1.5], [0.25] * 4, 0.75, 3, 0.25),
    ("pieces=0.25,0.25,0.25,0.25 gaps=0.5,0.2,0.2", [0.0, 0.5, 0.7, 0.9], [0.25] * 4, 0.25, 1, 0.25),
    ("pieces=0.3,0.3,0.3 gaps=0.1", [0.0, 0.1, 0.2], [0.3] * 3, 0.0, 0, 0.0),
    ("pieces=0.2,0.2 gaps=0.35", [0.0, 0.35], [0.2] * 2, 0.15, 1, 0.15),
]
TOLERANCE_S = 0.030


def _injected(sent: list[float], pieces: list[float]) -> dict:
    """The figures of what the server sent, when it sent it (a loaded host may write a chunk late;
    the client is judged on what it was given)."""
    from drama3_patches.tools.bench import playout

    return playout.request_figures([(t - sent[0], p) for t, p in zip(sent, pieces)], 0.0)


def test_playout_figures_match_the_injected_chunk_gaps(tmp_path):
    """Streams with scripted gaps through the stand-in server: every arrival, D, stall total and
    longest stall within 30 ms of what the server sent, and when (its clock, beside the scheduled
    timeline in PLAYOUT_STREAMS), the stall count exact (no injected stall lies near the 5 ms
    floor), and the level's shares where no figure is within 30 ms of a bound."""
    from drama3_patches.tools.bench import playout

    specs = [f"first=0.1 {words}" for words, *_ in PLAYOUT_STREAMS]
    meta = write_meta(tmp_path, specs)
    out = tmp_path / "out.json"
    sent = {}
    with SpeechServer() as server:
        for c in (1, 2):
            r = bench(server, meta, "--concurrency", str(c), "--limit", "4", "--warmup", "0", "--json",
                      str(out), "--force")
            assert r.returncode == 0, r.stderr
            sent[c] = dict(server.sent)
            doc = json.loads(out.read_text())
            _check_playout_level(doc["levels"][0], sent[c], specs, playout)
    # the summary line: D p50 and p99, C100
    c2 = doc["levels"][0]["playout"]
    row = r.stdout.splitlines()[2].split(" | ")
    assert row[5:8] == [f"{sb.sig3(c2['needed_cushion_s']['p50'])} s", f"{sb.sig3(c2['needed_cushion_s']['p99'])} s",
                        "25%"]


def _check_playout_level(level, sent, specs, playout):
    reqs = {x["utt"]: x for x in level["requests"]}
    given_figures = []
    for n, (_, times, pieces, _d, stalls, _longest) in enumerate(PLAYOUT_STREAMS):
        x = reqs[f"utt{n}"]
        arrivals = [a for a, _ in x["chunks"]]
        given = sent[specs[n]]
        injected = _injected(given, pieces)
        given_figures.append(injected | {"audio_s": sum(pieces)})
        assert [t - given[0] for t in given] == pytest.approx(times, abs=0.25)  # the schedule, roughly
        assert [s for _, s in x["chunks"]] == pytest.approx(pieces, abs=1e-6)  # from the byte counts
        assert arrivals[0] == pytest.approx(x["ttft"], abs=1e-6)
        assert [a - arrivals[0] for a in arrivals] == pytest.approx([t - given[0] for t in given], abs=TOLERANCE_S)
        assert x["needed_cushion_s"] == pytest.approx(injected["needed_cushion_s"], abs=TOLERANCE_S)
        assert x["stall_s"] == pytest.approx(injected["stall_s"], abs=TOLERANCE_S)
        assert x["longest_stall_s"] == pytest.approx(injected["longest_stall_s"], abs=TOLERANCE_S)
        assert x["stalls"] == injected["stalls"] == stalls
        assert x["stall_free_start_s"] == pytest.approx(x["ttft"] + x["needed_cushion_s"], abs=1e-9)
    po = level["playout"]
    assert po["streams"] == 4
    measured = [reqs[f"utt{n}"] for n in range(4)]
    assert po == playout.level_figures([m | {"audio_s": m["audio_seconds"]} for m in measured])
    # on schedule: longest stalls 0.25, 0.25, 0, 0.15 and D 0.75, 0.25, 0, 0.15, so C50 0.25, C100
    # 0.25, C200 0.5 and stall-free shares 0.25, 0.75, 1, 1; against what was sent, each figure at
    # least 50 ms from a bound unless the host held a chunk back that long
    given = playout.level_figures(given_figures)
    for key in ("c50", "c100", "c200", "stall_free_share"):
        assert po[key] == given[key], key
    for key in ("needed_cushion_s", "longest_stall_s"):
        assert po[key] == pytest.approx(given[key], abs=TOLERANCE_S), key


def test_failed_requests_carry_no_playout(tmp_path):
    meta = write_meta(tmp_path, ["pieces=0.2,0.2 gaps=0.1", "mode=http500"])
    with SpeechServer() as server:
        level = sb.run_level(sb.read_meta(str(meta)), 1, sb.Settings(url=server.url)).result()
    reqs = {x["utt"]: x for x in level["requests"]}
    assert reqs["utt1"]["needed_cushion_s"] is None and reqs["utt1"]["chunks"] == []
    assert len(reqs["utt0"]["chunks"]) == 2 and level["playout"]["streams"] == 1


def test_a_stream_of_many_tiny_pieces_keeps_a_bounded_record(monkeypatch):
    monkeypatch.setattr(sb, "MAX_CHUNKS", 3)
    counter = sb.AudioCounter("pcm", 1000)
    for i in range(10):
        counter.feed(b"\0\0" * 10, float(i))
    assert counter.arrivals == [[0.0, 20], [1.0, 20], [9.0, 160]]  # the rest joined the last, at its time
    assert counter.timeline(0.0) == [(0.0, 0.01), (1.0, 0.01), (9.0, 0.08)]
    assert counter.sample_bytes == 200
