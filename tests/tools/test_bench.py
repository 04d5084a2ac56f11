"""`drama3-patches bench` against a real HTTP server on 127.0.0.1 streaming synthetic audio.

The server injects the time to first audio, the audio length and the gaps; the
checks compare what the client measured with what was injected (lower bounds
from the injected sleeps, audio seconds exact from byte counts).
"""

from __future__ import annotations

import base64
import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from drama3_patches.tools.bench import speech as sb
from support.speech_server import NATIVE_RATE, SpeechServer, wav_header

REPO = Path(__file__).resolve().parents[2]
GAP, CHUNKS = 0.15, 4  # the stream goes on for 3 x GAP after the first samples


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def write_meta(d: Path, specs: list[str]) -> Path:
    (d / "wavs").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, spec in enumerate(specs):
        ref = d / "wavs" / f"ref{i}.wav"
        ref.write_bytes(wav_header(16000)[:-4] + struct.pack("<I", 4) + bytes([i, 0, i, 0]))
        lines.append(f"utt{i}|prompt text {i}|wavs/ref{i}.wav|{spec}")
    meta = d / "meta.lst"
    meta.write_text("\n".join(lines) + "\n")
    return meta


def bench(server, meta, *args):
    return subprocess.run([sys.executable, "-m", "drama3_patches.tools", "bench", "--url", server.url, "--meta",
                           str(meta), *args], capture_output=True, text=True, env=_env(), timeout=300)


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
    assert doc["lines"] == order
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
        assert (level["completed"], level["failed"]) == (6, 0)
        reqs = {x["utt"]: x for x in level["requests"]}
        for n in range(6):
            x = reqs[f"utt{n}"]
            assert x["audio_s"] == pytest.approx(AUDIOS[n], abs=1e-12)  # exact from the byte count
            assert x["sample_rate"] == NATIVE_RATE  # read from the WAV header
            # First samples come at `first`; the header alone (at 0.02 s) does not count,
            # and the stream goes on for 3 gaps more, which TTFA must not include.
            assert FIRSTS[n] <= x["ttfa"] < FIRSTS[n] + 3 * GAP
            assert x["elapsed"] >= FIRSTS[n] + 3 * GAP
            assert x["rtf"] == pytest.approx(x["elapsed"] / AUDIOS[n])
        ttfas = [x["ttfa"] for x in level["requests"]]
        assert level["ttfa_p50"] == pytest.approx(sb.percentile(ttfas, 50))
        assert level["ttfa_p99"] == pytest.approx(sb.percentile(ttfas, 99))
        assert sorted(ttfas)[2] <= level["ttfa_p50"] <= sorted(ttfas)[3]
        assert level["audio_seconds"] == pytest.approx(sum(AUDIOS))
        assert level["audio_s_per_s"] == pytest.approx(sum(AUDIOS) / level["wall_s"])
        assert level["rtf_mean"] == pytest.approx(sum(x["rtf"] for x in level["requests"]) / 6)
        assert level["wer"] is None and level["wer_note"] == "no --whisper model path given"
    c1, c3 = doc["levels"]
    assert c1["wall_s"] >= sum(f + 3 * GAP for f in FIRSTS)  # one at a time
    assert c3["wall_s"] < c1["wall_s"]

    # The table: the port's published columns plus completed/failed, and progress on stderr.
    lines = r.stdout.splitlines()
    assert lines[0] == "| concurrency | audio s/s | TTFA p50 | TTFA p99 | RTF mean | WER | completed | failed |"
    assert lines[2].startswith(f"| 1 | {sb.sig3(c1['audio_s_per_s'])} | {sb.sig3(c1['ttfa_p50'])} s | ")
    assert lines[3].endswith("| - | 6 | 0 |")
    assert "WER: - (no --whisper model path given)" in r.stdout
    assert "concurrency 3: 6/6 done, 0 failed" in r.stderr


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
    # Partial audio of failed requests is discarded.
    assert level["audio_seconds"] == pytest.approx(1.0)
    for utt in errors:
        assert f"failed: {utt}: " in r.stderr
    assert "| 2 | " in r.stdout and r.stdout.splitlines()[2].endswith("| 1 | 4 |")


def test_raw_audio_stream_and_pcm_with_requested_rate(tmp_path):
    meta = write_meta(tmp_path, ["audio=1.5 chunks=3 first=0.05", "audio=0.5 chunks=2"])
    with SpeechServer() as server:
        out = tmp_path / "wav.json"
        r = bench(server, meta, "--concurrency", "1", "--limit", "2", "--warmup", "0", "--stream-format", "audio",
                  "--json", str(out))
        assert r.returncode == 0, r.stderr
        level = json.loads(out.read_text())["levels"][0]
        assert level["audio_seconds"] == pytest.approx(2.0)
        ttfa = {x["utt"]: x["ttfa"] for x in level["requests"]}
        assert ttfa["utt0"] >= 0.05
        out = tmp_path / "pcm.json"
        r = bench(server, meta, "--concurrency", "2", "--limit", "2", "--warmup", "0", "--response-format", "pcm",
                  "--sample-rate", "24000", "--json", str(out))
        assert r.returncode == 0, r.stderr
        assert server.requests[-1]["sample_rate"] == 24000 and server.requests[-1]["response_format"] == "pcm"
    level = json.loads(out.read_text())["levels"][0]
    assert {x["utt"]: x["audio_s"] for x in level["requests"]} == {"utt0": pytest.approx(1.5),
                                                                    "utt1": pytest.approx(0.5)}
    assert {x["sample_rate"] for x in level["requests"]} == {24000}


def test_wer_column_says_why_it_is_empty(tmp_path):
    meta = write_meta(tmp_path, ["audio=0.2"])
    with SpeechServer() as server:
        r = bench(server, meta, "--concurrency", "1", "--limit", "1", "--warmup", "0", "--whisper",
                  str(tmp_path / "no-such-model"))
    assert r.returncode == 0, r.stderr
    assert f"WER: - ({tmp_path / 'no-such-model'} does not exist (models are never downloaded))" in r.stdout


@pytest.mark.parametrize("case", ["no_meta", "bad_line", "pcm_no_rate", "bad_levels", "no_ref", "bad_url"])
def test_bad_input_gets_one_clear_line(tmp_path, case):
    meta = write_meta(tmp_path, ["audio=0.2"])
    args = ["--url", "http://127.0.0.1:9", "--meta", str(meta)]
    expect = {
        "no_meta": "cannot read", "bad_line": ":1: expected utt_id|prompt_text|prompt_wav|target_text",
        "pcm_no_rate": "--response-format pcm has no header: give --sample-rate",
        "bad_levels": "--concurrency wants comma-separated integers", "no_ref": "cannot read reference audio",
        "bad_url": "--url must start with http:// or https://",
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
    else:
        args[1] = "127.0.0.1:9"
    r = subprocess.run([sys.executable, "-m", "drama3_patches.tools", "bench", *args], capture_output=True, text=True,
                       env=_env(), timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("drama3-patches bench: ") and expect in lines[0], r.stderr


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for n in (1, 2, 7, 64):
        values = [rng.random() * 10 for _ in range(n)]
        for q in (50, 99):
            assert sb.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert sb.percentile([], 50) is None


def test_word_errors_and_wav_header_parsing():
    assert sb.word_errors("Hello, world! It's me.", "hello world its me") == (1, 4)
    assert sb.word_errors("a b c", "a x c d") == (2, 3)
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


def test_wer_scoring_sees_each_completed_stream_audio(tmp_path):
    """The transcriber gets exactly the sample bytes of each completed stream (failed ones are not scored)."""
    meta = write_meta(tmp_path, ["audio=0.5 chunks=2 the cat sat", "audio=0.25 mode=error a dog", "audio=1.0 hello"])
    lines = sb.read_meta(str(meta))
    seen = []

    def transcribe(pcm, rate, channels):
        seen.append((len(pcm), rate, channels))
        return {16000: "the cat sat", 32000: "hello there"}[len(pcm)]

    with SpeechServer() as server:
        s = sb.Settings(url=server.url, keep_audio=True)
        level = sb.run_level(lines, 2, s)
    sb.score_level(level, {"utt0": "the cat sat", "utt1": "a dog", "utt2": "hello"}, transcribe)
    assert sorted(seen) == [(16000, NATIVE_RATE, 1), (32000, NATIVE_RATE, 1)]
    # refs: "the cat sat" (3 words, 0 errors) and "hello" (1 word, 1 insertion)
    assert level.wer == pytest.approx(1 / 4)
    assert level.summary()["wer"] == pytest.approx(0.25)


def test_unreachable_server_counts_every_request_as_failed(tmp_path):
    import socket

    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    meta = write_meta(tmp_path, ["audio=0.2", "audio=0.3"])
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "drama3_patches.tools", "bench", "--url", f"http://127.0.0.1:{port}",
                        "--meta", str(meta), "--concurrency", "2", "--limit", "2", "--warmup", "1", "--json",
                        str(out)], capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == 1
    (level,) = json.loads(out.read_text())["levels"]
    assert (level["completed"], level["failed"]) == (0, 2)
    assert all(f["error"].startswith("ConnectionRefusedError") for f in level["failures"])
    assert level["audio_s_per_s"] == 0 and level["ttfa_p50"] is None
    assert r.stdout.splitlines()[2] == "| 2 | 0.00 | - | - | - | - | 0 | 2 |"
