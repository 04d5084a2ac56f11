"""Seed-TTS-Eval style load test of vLLM-Omni's ``/v1/audio/speech`` (streaming).

The load itself is stdlib only (threads and ``http.client``); scoring the
audio (``wer``, ``sim``) imports its packages when asked for. Each line of a Seed-TTS-Eval
``meta.lst`` (``utt_id|prompt_text|prompt_wav|target_text``, paths relative to
the list) clones its own reference. Lines are shuffled with the seed and the
same lines run at every concurrency.

Per request: time to first audio (the first byte of samples, after any WAV
header), audio seconds (sample bytes / (rate x channels x bytes per sample);
rate from the WAV header, or the requested ``sample_rate`` for PCM), and
real-time factor (request time / audio seconds), and each piece of audio's arrival and
length, as numbers (``playout.py`` turns them into stalls and the cushion a player needs). A
request that ends with an
HTTP error, an ``speech.audio.error`` event, or without ``speech.audio.done``
(truncated) is a failure and its partial audio is discarded.

A server is not trusted to behave: each request has a wall-clock deadline (``timeout``
seconds from the send, however slowly bytes trickle in), an SSE line or event is
bounded (``MAX_EVENT_BYTES``), a WAV header that makes no sense (no fmt chunk, zero
bits, no channels) and any malformed event are that request's failure. Nothing a
server sends can end the run or lose the results of other requests.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import os
import random
import socket
import struct
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from drama3_patches.tools.bench.stats import percentile
from drama3_patches.tools.files import MIB, InputError, read_text

SPEECH_PATH = "/v1/audio/speech"
# One SSE line or event: a delta carries base64 audio (4/3 of its bytes), 16 MiB is about
# four minutes of 24 kHz 16-bit mono in one event, far above any streamed chunk.
MAX_EVENT_BYTES = 16 * MIB
MAX_WAV_HEADER = 64 * 1024  # RIFF chunks before "data"; vLLM-Omni's header is 44 bytes
MAX_REF_BYTES = 32 * MIB  # a reference clip (Seed-TTS-Eval's are seconds long, well under 1 MiB)
MAX_META_BYTES = 64 * MIB
# Chunk arrivals kept per request (numbers only): far above a real stream's (Drama 3 sends a
# window of 6 to 64 frames at a time); past it, later pieces join the last record, stamped
# with the later arrival, so a server that sends single bytes cannot grow the record.
MAX_CHUNKS = 20000


@dataclass(frozen=True)
class MetaLine:
    utt: str
    prompt_text: str
    prompt_wav: str  # absolute path
    text: str


class BenchError(InputError):
    """Bad input to the benchmark; one line for the operator."""


def read_meta(path: str) -> list[MetaLine]:
    base = os.path.dirname(os.path.abspath(path))
    try:
        raw = read_text(path, MAX_META_BYTES, "meta list").splitlines()
    except InputError as exc:
        raise BenchError(str(exc)) from None
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
        if pos + 8 + size > MAX_WAV_HEADER:
            raise ValueError(f"WAV header: no data chunk in the first {MAX_WAV_HEADER} bytes")
        if len(buf) < pos + 8 + size:
            return None
        if cid == b"fmt ":
            if size < 16:
                raise ValueError(f"WAV fmt chunk of {size} bytes (16 at least)")
            _, channels, rate, _, _, bits = struct.unpack("<HHIIHH", buf[pos + 8:pos + 24])
            if channels < 1 or rate < 1 or bits < 8 or bits % 8:
                raise ValueError(f"WAV fmt chunk says {channels} channel(s), {rate} Hz, {bits} bits per sample")
            fmt = (rate, channels, bits)
        pos += 8 + size + (size & 1)
    if len(buf) > MAX_WAV_HEADER:
        raise ValueError(f"WAV header: no data chunk in the first {MAX_WAV_HEADER} bytes")
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
        self.arrivals: list[list] = []  # [clock time, sample bytes] per piece of audio read

    def _arrived(self, now: float, size: int) -> None:
        if len(self.arrivals) < MAX_CHUNKS:
            self.arrivals.append([now, size])
        else:
            self.arrivals[-1][0] = now
            self.arrivals[-1][1] += size

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
            self._arrived(now, len(data))
            if self.keep:
                self.chunks.append(data)

    @property
    def seconds(self) -> float:
        if not self.rate:
            return 0.0
        return self.sample_bytes / (self.rate * self.channels * (self.bits // 8))

    def timeline(self, start: float) -> list[tuple[float, float]]:
        """``(arrival_s, audio_s)`` per piece: seconds since ``start`` (the send), seconds of audio."""
        per_s = self.rate * self.channels * (self.bits // 8) if self.rate else 0
        return [(t - start, size / per_s) for t, size in self.arrivals] if per_s else []


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
    chunks: list = field(default_factory=list, repr=False)  # (arrival_s, audio_s): playout.py

    def playout(self) -> dict:
        """The request's playout figures (``playout.request_figures``); all None when it failed."""
        from drama3_patches.tools.bench import playout

        if not self.ok:
            return dict.fromkeys(("needed_cushion_s", "stalls", "stall_s", "longest_stall_s",
                                  "stall_free_start_s"), None) | {"chunks": []}
        return playout.request_figures(self.chunks, self.ttfa)

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


def read_ref(path: str) -> bytes:
    """A reference clip's bytes: a regular file of at most ``MAX_REF_BYTES``."""
    from drama3_patches.tools.files import read_regular

    try:
        return read_regular(path, MAX_REF_BYTES, "reference audio")[0]
    except InputError as exc:
        raise BenchError(str(exc)) from None


def _ref_audio(path: str, mode: str) -> str:
    if mode == "file":
        return "file://" + os.path.abspath(path)
    return "data:audio/wav;base64," + base64.b64encode(read_ref(path)).decode("ascii")


def build_body(line: MetaLine, s: Settings) -> dict:
    body = {"input": line.text, "ref_audio": _ref_audio(line.prompt_wav, s.ref_audio), "ref_text": line.prompt_text,
            "response_format": s.response_format, "stream": True, "stream_format": s.stream_format}
    if s.model:
        body["model"] = s.model
    if s.sample_rate:
        body["sample_rate"] = s.sample_rate
    body.update(s.extra)
    return body


def check_url(url: str) -> str | None:
    """Why ``url`` cannot be a server address, or None."""
    if not url.startswith(("http://", "https://")):
        return f"--url must start with http:// or https://, got {url!r}"
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port  # parses the port: ValueError when it is not a number in 0..65535
    except ValueError as exc:
        return f"--url {url!r}: {exc}"
    if not u.hostname:
        return f"--url {url!r} names no host"
    if port == 0:
        return f"--url {url!r}: port 0"
    return None


def _connection(url: str, timeout: float):
    u = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    path = u.path if u.path not in ("", "/") else SPEECH_PATH
    return cls(u.hostname, u.port, timeout=timeout), path + (f"?{u.query}" if u.query else "")


_ACTIVE: set = set()  # the deadlines of the requests in flight, for expire_all
_ACTIVE_LOCK = threading.Lock()
# Set by expire_all, cleared when a level starts: a worker that took its line before the Ctrl-C
# but entered its deadline after it (building the body) is cut too, not left to run to --timeout
# while the interpreter's exit waits for it.
_STOPPED = threading.Event()


def expire_all() -> None:
    """End every request in flight now (Ctrl-C), and any that starts after: each fails with its
    deadline's error."""
    with _ACTIVE_LOCK:
        _STOPPED.set()
        active = list(_ACTIVE)
    for deadline in active:
        deadline.timer.cancel()
        deadline._expire()


class Deadline:
    """A request's wall-clock limit: at ``seconds`` after the start the connection's socket is
    shut down, which ends any read in progress, however the server trickles its bytes (a
    socket timeout alone bounds only the wait for each byte). The socket is kept from connect
    time: when a response will close the connection (HTTP/1.0, ``Connection: close``),
    ``http.client`` hands the socket to the response and the connection drops it."""

    def __init__(self, conn, seconds: float):
        self.conn, self.seconds, self.expired = conn, seconds, False
        self.sock = None
        self.timer = threading.Timer(seconds, self._expire)
        self.timer.daemon = True

    def connected(self) -> None:
        self.sock = self.conn.sock

    def _expire(self) -> None:
        self.expired = True
        sock = self.sock or getattr(self.conn, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass

    def __enter__(self):
        with _ACTIVE_LOCK:
            _ACTIVE.add(self)
            stopped = _STOPPED.is_set()
        if stopped:
            self._expire()
        else:
            self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        with _ACTIVE_LOCK:
            _ACTIVE.discard(self)

    @property
    def error(self) -> str:
        return f"deadline: no complete response within --timeout {self.seconds:g} s"


def _readline(resp) -> bytes:
    raw = resp.readline(MAX_EVENT_BYTES + 1)
    if len(raw) > MAX_EVENT_BYTES:
        raise ValueError(f"SSE line over {MAX_EVENT_BYTES} bytes")
    return raw


def _delta_audio(obj: dict) -> bytes:
    audio = obj.get("audio") or ""
    if not isinstance(audio, str):
        raise ValueError(f"speech.audio.delta whose audio is {type(audio).__name__}, not base64 text")
    try:
        return base64.b64decode(audio, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"speech.audio.delta with bad base64 audio ({exc})") from None


def _error_text(obj: dict) -> str:
    """The message of an error event: ``error`` is an object with ``message``, or plain text."""
    err = obj.get("error")
    if isinstance(err, dict):
        err = err.get("message", err)
    return str(err if err not in (None, "") else "(no message)")[:300]


def _read_sse(resp, counter: AudioCounter, clock) -> str | None:
    """Consume an SSE stream; None when it ended with speech.audio.done, else the failure."""
    event, data, size = None, [], 0
    while True:
        raw = _readline(resp)
        if not raw:
            return "truncated stream: ended without speech.audio.done"
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            return f"bad SSE line: not UTF-8: {raw[:80]!r}"
        if line.startswith(":"):
            continue
        if line:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
                size += len(value)
                if size > MAX_EVENT_BYTES:
                    return f"bad SSE event: over {MAX_EVENT_BYTES} bytes of data"
            continue
        if not data:
            event = None
            continue
        payload = "\n".join(data)
        event_type, data, size = event, [], 0
        event = None
        if payload.strip() == "[DONE]":
            return "stream ended with [DONE] but no speech.audio.done"
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):
            return f"bad SSE data: {payload[:80]!r}"
        if not isinstance(obj, dict):
            return f"bad SSE data: a JSON {type(obj).__name__}, not an object: {payload[:80]!r}"
        kind = obj.get("type") or event_type
        if kind == "speech.audio.delta":
            try:
                audio = _delta_audio(obj)
            except ValueError as exc:
                return f"bad SSE data: {exc}"
            try:
                counter.feed(audio, clock())
            except ValueError as exc:
                return f"bad audio: {exc}"
        elif kind == "speech.audio.done":
            return None
        elif kind == "speech.audio.error":
            return f"server error: {_error_text(obj)}"


def speak(line: MetaLine, s: Settings, clock=time.perf_counter) -> Result:
    """One streamed request; never raises for a server or network failure."""
    counter = AudioCounter(s.response_format, s.sample_rate)
    counter.keep = s.keep_audio
    start = clock()
    res = Result(line.utt, ok=False, start=start)
    try:
        body = json.dumps(build_body(line, s)).encode()
        conn, path = _connection(s.url, s.timeout)
    except (InputError, ValueError) as exc:  # a reference gone since the start, a bad URL
        res.error, res.end = f"{exc}", clock()
        return res
    deadline = Deadline(conn, s.timeout)
    try:
        with deadline:
            if deadline.expired:  # a Ctrl-C before this request began
                raise TimeoutError("interrupted before the request was sent")
            conn.connect()  # bounded by the socket timeout; the deadline may pass during it
            deadline.connected()
            if deadline.expired:
                raise TimeoutError("deadline passed while connecting")
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
    if deadline.expired:  # whatever the read saw after the shutdown, the cause is the deadline
        res.ok, res.error = False, deadline.error
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
        res.chunks = counter.timeline(start)
        if s.keep_audio:
            res.audio = b"".join(counter.chunks)
    return res


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
        The speech figures (audio seconds, audio throughput, RTF, WER, SIM) sit beside them, and
        ``playout`` (``playout.level_figures``): stalls and the cushion a player needs.
        """
        from drama3_patches.tools.bench import playout

        ok = self.ok
        audio = sum(r.audio_s for r in ok)
        figures = [r.playout() for r in self.results]
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
            "playout": playout.level_figures([f | {"audio_s": r.audio_s}
                                              for r, f in zip(self.results, figures) if r.ok]),
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
                          "channels": r.channels, "rtf": r.rtf, **f} for r, f in zip(self.results, figures)],
        }
        return out


def speak_kept(line: MetaLine, s: Settings) -> Result:
    """:func:`speak`, and should it still raise (a bug here, not the server's doing), the request
    is that failure, named as a bug: the level's other results are kept either way."""
    try:
        return speak(line, s)
    except Exception as exc:
        now = time.perf_counter()
        return Result(line.utt, ok=False, error=f"bench bug (please report): {type(exc).__name__}: {exc}",
                      start=now, end=now)


def run_level(lines: list[MetaLine], concurrency: int, s: Settings, warmup: int = 0, progress=None) -> Level:
    """``progress``: an object with ``tick(ok)`` (see ``progress.make``), or None."""
    _STOPPED.clear()  # a level after an interrupted one (a caller that went on) streams again
    for line in lines[:warmup]:
        speak_kept(line, s)  # excluded: first-request costs (graph warm-up, caches)

    def one(line):
        r = speak_kept(line, s)
        if progress is not None:
            progress.tick(r.ok)
        return r

    if progress is not None:
        progress.start()
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        results = list(pool.map(one, lines))
    except KeyboardInterrupt:
        # Start no more lines and cut the ones in flight, rather than wait up to --timeout for them.
        pool.shutdown(wait=False, cancel_futures=True)
        expire_all()
        raise
    pool.shutdown()
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
    """The port's published columns (seconds, as it prints them), the playout figures (D, the
    cushion a player needs, p50 and p99; C100, the share of streams whose longest stall is at
    most 100 ms), then SIM, completed and failed."""
    rows = ["| concurrency | audio s/s | TTFA p50 | TTFA p99 | RTF mean | D p50 | D p99 | C100 | WER | SIM | "
            "completed | failed |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def secs(ms):
        return "-" if ms is None else sig3(ms / 1e3) + " s"

    for lv in levels:
        wer = "-" if lv["wer"] is None else f"{lv['wer'] * 100:.2f}%"
        sim = "-" if lv["sim"] is None else f"{lv['sim']:.3f}"
        po = lv.get("playout") or {}
        d = po.get("needed_cushion_s") or {}
        c100 = "-" if po.get("c100") is None else f"{po['c100'] * 100:.0f}%"
        rows.append(f"| {lv['max_concurrency']} | {sig3(lv['audio_throughput'])} | {secs(lv['median_ttft_ms'])} | "
                    f"{secs(lv['p99_ttft_ms'])} | {sig3(lv['mean_rtf'])} | {secs(_ms(d.get('p50')))} | "
                    f"{secs(_ms(d.get('p99')))} | {c100} | {wer} | {sim} | {lv['completed']} | {lv['failed']} |")
    notes = [f"WER: - ({wer_note})" if wer_note else "", f"SIM: - ({sim_note})" if sim_note else ""]
    if any(notes):
        rows.append("\n" + "\n".join(n for n in notes if n))
    return "\n".join(rows)


def _ms(seconds):
    return None if seconds is None else seconds * 1e3
