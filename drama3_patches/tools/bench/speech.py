"""Seed-TTS-Eval style load test of vLLM-Omni's ``/v1/audio/speech`` (streaming).

The load itself is stdlib only (threads and ``http.client``); scoring the
audio (``wer``, ``sim``) imports its packages when asked for. Each line of a Seed-TTS-Eval
``meta.lst`` (``utt_id|prompt_text|prompt_wav|target_text``, paths relative to
the list) clones its own reference. Lines are shuffled with the seed and the
same lines run at every concurrency.

Per request: time to first audio (the first byte of samples, after any WAV
header), audio seconds (sample bytes / (rate x channels x bytes per sample);
rate from the WAV header, or the requested ``sample_rate`` for PCM), and
real-time factor (request time / audio seconds). A request that ends with an
HTTP error, an ``speech.audio.error`` event, or without ``speech.audio.done``
(truncated) is a failure and its partial audio is discarded.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import struct
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

SPEECH_PATH = "/v1/audio/speech"


@dataclass(frozen=True)
class MetaLine:
    utt: str
    prompt_text: str
    prompt_wav: str  # absolute path
    text: str


class BenchError(Exception):
    """Bad input to the benchmark; one line for the operator."""


def read_meta(path: str) -> list[MetaLine]:
    base = os.path.dirname(os.path.abspath(path))
    try:
        with open(path, encoding="utf-8") as fh:
            raw = fh.read().splitlines()
    except OSError as exc:
        raise BenchError(f"{path}: cannot read: {exc.strerror}") from None
    lines = []
    for n, line in enumerate(raw, 1):
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) < 4:
            raise BenchError(f"{path}:{n}: expected utt_id|prompt_text|prompt_wav|target_text")
        utt, prompt_text, wav, text = parts[0], parts[1], parts[2], "|".join(parts[3:])
        lines.append(MetaLine(utt, prompt_text, os.path.join(base, wav), text))
    if not lines:
        raise BenchError(f"{path}: no lines")
    return lines


def pick_lines(lines: list[MetaLine], seed: int, limit: int) -> list[MetaLine]:
    chosen = list(lines)
    random.Random(seed).shuffle(chosen)
    return chosen[:limit]


def parse_wav_header(buf: bytes):
    """(sample_rate, channels, bits, data_offset) once the header is complete, else None."""
    if len(buf) < 12:
        return None
    if buf[:4] != b"RIFF" or buf[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE stream")
    pos, fmt = 12, None
    while len(buf) >= pos + 8:
        cid, size = buf[pos:pos + 4], struct.unpack("<I", buf[pos + 4:pos + 8])[0]
        if cid == b"data":
            if fmt is None:
                raise ValueError("WAV data chunk before its fmt chunk")
            return fmt[0], fmt[1], fmt[2], pos + 8
        if len(buf) < pos + 8 + size:
            return None
        if cid == b"fmt ":
            _, channels, rate, _, _, bits = struct.unpack("<HHIIHH", buf[pos + 8:pos + 24])
            fmt = (rate, channels, bits)
        pos += 8 + size + (size & 1)
    return None


class AudioCounter:
    """Counts sample bytes of a pcm or wav byte stream and stamps the first one."""

    def __init__(self, response_format: str, sample_rate: int | None):
        self.wav = response_format == "wav"
        self.head = b""
        self.rate, self.channels, self.bits = (sample_rate, 1, 16)
        self.sample_bytes = 0
        self.first_audio: float | None = None
        self.ready = not self.wav
        self.chunks: list[bytes] = []
        self.keep = False

    def feed(self, data: bytes, now: float) -> None:
        if not self.ready:
            self.head += data
            parsed = parse_wav_header(self.head)
            if parsed is None:
                return
            self.rate, self.channels, self.bits, offset = parsed
            data, self.head, self.ready = self.head[offset:], b"", True
        if data:
            if self.first_audio is None:
                self.first_audio = now
            self.sample_bytes += len(data)
            if self.keep:
                self.chunks.append(data)

    @property
    def seconds(self) -> float:
        if not self.rate:
            return 0.0
        return self.sample_bytes / (self.rate * self.channels * (self.bits // 8))


@dataclass
class Result:
    utt: str
    ok: bool
    error: str = ""
    ttfa: float | None = None
    elapsed: float = 0.0
    audio_s: float = 0.0
    start: float = 0.0
    end: float = 0.0
    sample_rate: int | None = None
    channels: int = 1
    bits: int = 16
    audio: bytes = field(default=b"", repr=False)

    @property
    def rtf(self) -> float | None:
        return self.elapsed / self.audio_s if self.ok and self.audio_s else None


@dataclass
class Settings:
    url: str
    model: str | None = None
    response_format: str = "wav"
    stream_format: str = "sse"
    sample_rate: int | None = None
    timeout: float = 600.0
    ref_audio: str = "data"  # data | file
    keep_audio: bool = False
    extra: dict = field(default_factory=dict)


def _ref_audio(path: str, mode: str) -> str:
    if mode == "file":
        return "file://" + os.path.abspath(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise BenchError(f"{path}: cannot read reference audio: {exc.strerror}") from None
    return "data:audio/wav;base64," + base64.b64encode(data).decode("ascii")


def build_body(line: MetaLine, s: Settings) -> dict:
    body = {"input": line.text, "ref_audio": _ref_audio(line.prompt_wav, s.ref_audio), "ref_text": line.prompt_text,
            "response_format": s.response_format, "stream": True, "stream_format": s.stream_format}
    if s.model:
        body["model"] = s.model
    if s.sample_rate:
        body["sample_rate"] = s.sample_rate
    body.update(s.extra)
    return body


def _connection(url: str, timeout: float):
    u = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    path = u.path if u.path not in ("", "/") else SPEECH_PATH
    return cls(u.hostname, u.port, timeout=timeout), path + (f"?{u.query}" if u.query else "")


def _read_sse(resp, counter: AudioCounter, clock) -> str | None:
    """Consume an SSE stream; None when it ended with speech.audio.done, else the failure."""
    event, data = None, []
    while True:
        raw = resp.readline()
        if not raw:
            return "truncated stream: ended without speech.audio.done"
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith(":"):
            continue
        if line:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
            continue
        if not data:
            event = None
            continue
        payload = "\n".join(data)
        event_type, data = event, []
        event = None
        if payload.strip() == "[DONE]":
            return "stream ended with [DONE] but no speech.audio.done"
        try:
            obj = json.loads(payload)
        except ValueError:
            return f"bad SSE data: {payload[:80]!r}"
        kind = obj.get("type") or event_type
        if kind == "speech.audio.delta":
            counter.feed(base64.b64decode(obj.get("audio") or ""), clock())
        elif kind == "speech.audio.done":
            return None
        elif kind == "speech.audio.error":
            err = obj.get("error") or {}
            return f"server error: {err.get('message', err)}"


def speak(line: MetaLine, s: Settings, clock=time.perf_counter) -> Result:
    """One streamed request; never raises for a server or network failure."""
    counter = AudioCounter(s.response_format, s.sample_rate)
    counter.keep = s.keep_audio
    body = json.dumps(build_body(line, s)).encode()
    start = clock()
    res = Result(line.utt, ok=False, start=start)
    conn, path = _connection(s.url, s.timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                        "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            detail = resp.read(300).decode("utf-8", "replace").strip()
            res.error = f"HTTP {resp.status}: {detail}"
        elif s.stream_format == "sse":
            res.error = _read_sse(resp, counter, clock) or ""
            res.ok = not res.error
        else:
            while True:
                chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
                if not chunk:
                    break
                counter.feed(chunk, clock())
            res.ok = True
    except http.client.IncompleteRead:
        res.error = "truncated stream: connection closed mid-response"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    res.end = clock()
    res.elapsed = res.end - start
    if res.ok and not counter.ready:
        res.ok, res.error = False, "stream ended before the WAV header was complete"
    if res.ok and counter.sample_bytes == 0:
        res.ok, res.error = False, "no audio in the stream"
    if res.ok and not counter.rate:
        res.ok, res.error = False, "PCM without a sample rate: pass --sample-rate"
    if res.ok:
        res.ttfa = counter.first_audio - start
        res.audio_s = counter.seconds
        res.sample_rate = counter.rate
        res.channels = counter.channels
        res.bits = counter.bits
        if s.keep_audio:
            res.audio = b"".join(counter.chunks)
    return res


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default, which vLLM's benchmark uses)."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


PERCENTILES = (50, 99)


def latency_fields(metric: str, seconds: list[float]) -> dict:
    """``vllm bench serve``'s statistics of one latency metric, in milliseconds, under its key names."""
    if not seconds:
        out = {f"{s}_{metric}_ms": None for s in ("mean", "median", "std")}
        return out | {f"p{p}_{metric}_ms": None for p in PERCENTILES}
    mean = sum(seconds) / len(seconds)
    std = (sum((x - mean) ** 2 for x in seconds) / len(seconds)) ** 0.5  # population, as numpy.std
    out = {f"mean_{metric}_ms": mean * 1e3, f"median_{metric}_ms": percentile(seconds, 50) * 1e3,
           f"std_{metric}_ms": std * 1e3}
    return out | {f"p{p}_{metric}_ms": percentile(seconds, p) * 1e3 for p in PERCENTILES}


@dataclass
class Level:
    concurrency: int
    results: list[Result]
    wall_s: float
    wer: object = None  # wer.WerScore once scored
    wer_note: str = ""
    sim: object = None  # sim.SimScore once scored
    sim_note: str = ""

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.ok]

    def result(self) -> dict:
        """One concurrency level: ``vllm bench serve``'s result keys where a figure has one.

        TTFT here is the time to first audio (TTFA): request sent to the first
        sample bytes, the WAV header excluded; e2el is the whole streamed request.
        The speech figures (audio seconds, audio throughput, RTF, WER, SIM) sit beside them.
        """
        ok = self.ok
        audio = sum(r.audio_s for r in ok)
        rtfs = [r.rtf for r in ok if r.rtf is not None]
        t0 = min((r.start for r in self.results), default=0.0)
        out = {
            "max_concurrency": self.concurrency, "num_prompts": len(self.results), "duration": self.wall_s,
            "completed": len(ok), "failed": len(self.results) - len(ok),
            "request_throughput": len(ok) / self.wall_s if self.wall_s > 0 else None,
            **latency_fields("ttft", [r.ttfa for r in ok]), **latency_fields("e2el", [r.elapsed for r in ok]),
            "audio_seconds": audio, "audio_throughput": audio / self.wall_s if self.wall_s > 0 else None,
            "mean_rtf": sum(rtfs) / len(rtfs) if rtfs else None, "median_rtf": percentile(rtfs, 50),
            "p99_rtf": percentile(rtfs, 99),
        }
        out |= self.wer.fields() if self.wer is not None else {"wer": None}
        out["wer_note"] = self.wer_note
        out |= self.sim.fields() if self.sim is not None else {"sim": None}
        out["sim_note"] = self.sim_note
        out |= {
            "ttfts": [r.ttfa for r in self.results], "latencies": [r.elapsed for r in self.results],
            "start_times": [r.start - t0 for r in self.results], "errors": [r.error for r in self.results],
            "failures": [{"utt": r.utt, "error": r.error} for r in self.results if not r.ok],
            "requests": [{"utt": r.utt, "success": r.ok, "error": r.error, "ttft": r.ttfa, "latency": r.elapsed,
                          "start_time": r.start - t0, "audio_seconds": r.audio_s, "sample_rate": r.sample_rate,
                          "channels": r.channels, "rtf": r.rtf} for r in self.results],
        }
        return out


def run_level(lines: list[MetaLine], concurrency: int, s: Settings, warmup: int = 0, progress=None) -> Level:
    """``progress``: an object with ``tick(ok)`` (see ``progress.make``), or None."""
    for line in lines[:warmup]:
        speak(line, s)  # excluded: first-request costs (graph warm-up, caches)

    def one(line):
        r = speak(line, s)
        if progress is not None:
            progress.tick(r.ok)
        return r

    if progress is not None:
        progress.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, lines))
    return Level(concurrency, results, time.perf_counter() - t0)


def score_level(level: Level, lines: dict[str, MetaLine], transcribe=None, sim_scorer=None, method="seed-tts-eval",
                progress=None) -> None:
    """Transcribe (WER) and embed (SIM) every completed stream of the level; failed ones are not scored."""
    from drama3_patches.tools.bench import wer as wer_mod
    from drama3_patches.tools.bench.audio import to_model_rate

    from drama3_patches.tools.bench.sim import SimScore

    pairs, asr_failed, sims = [], [], SimScore()
    for r in level.ok:
        if r.bits != 16:  # the scorers read 16-bit PCM, what vLLM-Omni streams
            reason = {"utt": r.utt, "reason": f"{r.bits}-bit samples: only 16-bit PCM is scored"}
            asr_failed.append(reason)
            sims.skipped.append(reason)
            if progress is not None:
                progress.tick(False)
            continue
        audio = to_model_rate(r.audio, r.sample_rate, r.channels)
        line = lines[r.utt]
        ok = True
        if transcribe is not None:
            try:
                pairs.append((r.utt, line.text, transcribe(audio)))
            except Exception as exc:  # one clip the model chokes on is reported, the rest still count
                asr_failed.append({"utt": r.utt, "reason": f"transcriber failed: {type(exc).__name__}: {exc}"})
                ok = False
        if sim_scorer is not None:
            ok = sim_scorer.add(sims, r.utt, audio, line.prompt_wav) and ok
        if progress is not None:
            progress.tick(ok)
    if transcribe is not None:
        level.wer = wer_mod.score(pairs, method)
        level.wer.skipped += asr_failed
    if sim_scorer is not None:
        level.sim = sims


def sig3(value) -> str:
    """Three significant digits, trailing zeros kept (0.569, 7.20, 14.0), as in the port's table."""
    if value is None:
        return "-"
    text = f"{value:#.3g}"
    return text.rstrip(".") if "e" not in text else f"{value:.3g}"


def table(levels: list[dict], wer_note: str | None = None, sim_note: str | None = None) -> str:
    """The port's published columns (seconds, as it prints them), then SIM, completed and failed."""
    rows = ["| concurrency | audio s/s | TTFA p50 | TTFA p99 | RTF mean | WER | SIM | completed | failed |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def secs(ms):
        return "-" if ms is None else sig3(ms / 1e3) + " s"

    for lv in levels:
        wer = "-" if lv["wer"] is None else f"{lv['wer'] * 100:.2f}%"
        sim = "-" if lv["sim"] is None else f"{lv['sim']:.3f}"
        rows.append(f"| {lv['max_concurrency']} | {sig3(lv['audio_throughput'])} | {secs(lv['median_ttft_ms'])} | "
                    f"{secs(lv['p99_ttft_ms'])} | {sig3(lv['mean_rtf'])} | {wer} | {sim} | {lv['completed']} | "
                    f"{lv['failed']} |")
    notes = [f"WER: - ({wer_note})" if wer_note else "", f"SIM: - ({sim_note})" if sim_note else ""]
    if any(notes):
        rows.append("\n" + "\n".join(n for n in notes if n))
    return "\n".join(rows)
