"""A stand-in for vLLM-Omni's streaming ``POST /v1/audio/speech`` with injected timing.

The wire format follows vllm-omni 0.30.0 ``entrypoints/openai/serving_speech.py``:
SSE events ``speech.audio.delta`` (base64 ``audio``), ``speech.audio.done`` and
``speech.audio.error``; for ``wav`` the 44-byte header (data size 0xFFFFFFFF)
is its own first chunk; ``stream_format: audio`` sends the raw bytes.

What each request does is read from ``key=value`` words of its ``input`` text
or of its ``ref_text`` (the prompt transcript, so that a meta.lst can keep the
target text clean):
``first`` (s before the first samples), ``header`` (s before the WAV header),
``audio`` (s of audio), ``chunks``, ``gap`` (s between chunks), a scripted timeline instead:
``pieces`` (comma-separated seconds of audio per chunk) and ``gaps`` (comma-separated seconds
before each chunk after the first; the last one repeats), and ``mode``:
``ok``, ``error`` (error event after partial audio), ``cut`` (connection closed
inside a chunk), ``nodone`` (clean end without ``speech.audio.done``), ``http500``.

Misbehaving servers, one ``mode`` each (see ``MISBEHAVIOURS``): ``trickle`` (a comment line
sent a byte every 0.05 s for ``trickle`` seconds, default 30: alive but never done),
``badjson`` (data that is not JSON), ``notobject`` (JSON that is a list), ``numaudio`` (a
delta whose audio is a number), ``strerror`` (an error event whose ``error`` is a string),
``zerobits`` (a WAV header of 0 bits per sample), ``shortfmt`` (an 8-byte fmt chunk),
``hugeline`` (one data line of ``huge`` bytes, default 17 MiB, then a newline).

``POST /start_profile`` and ``/stop_profile`` answer as vLLM-Omni's do when a stage has a
profiler config (``profiler = False``: 404, as when none has); ``on_stop_profile`` stands in for
the worker writing its trace.

The samples "say" the other words of the input: their bytes repeat
``TXT:<words>\\0``, which ``transcribe`` reads back, so WER can be scored end
to end; ``heard=some_other_words`` makes the audio say those words instead
(a misrecognition on demand). ``embed`` is a stand-in speaker embedder.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NATIVE_RATE = 16000


def wav_header(rate: int, channels: int = 1, bits: int = 16) -> bytes:
    return struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", 0xFFFFFFFF, b"WAVE", b"fmt ", 16, 1, channels, rate,
                       rate * channels * bits // 8, channels * bits // 8, bits, b"data", 0xFFFFFFFF)


def short_fmt_header(rate: int) -> bytes:
    """A WAV header whose fmt chunk is 8 bytes (16 at least in a real one)."""
    return struct.pack("<4sI4s4sIHHI4sI", b"RIFF", 0xFFFFFFFF, b"WAVE", b"fmt ", 8, 1, 1, rate, b"data", 0xFFFFFFFF)


MISBEHAVIOURS = ("trickle", "badjson", "notobject", "numaudio", "strerror", "zerobits", "shortfmt", "hugeline")


def parse_spec(text: str, prompt: str = "") -> dict:
    """Keys from the prompt transcript, then from the input (which wins); words from the input only."""
    spec = {"first": 0.0, "header": 0.0, "audio": 1.0, "chunks": 4, "gap": 0.0, "mode": "ok", "heard": None,
            "trickle": 30.0, "huge": 17 * 1024 * 1024, "pieces": None, "gaps": None}
    words = []
    for source, word in [("prompt", w) for w in prompt.split()] + [("input", w) for w in text.split()]:
        key, sep, value = word.partition("=")
        if sep and key in spec:
            spec[key] = (value.replace("_", " ") if key == "heard" else value if key == "mode"
                         else [float(v) for v in value.split(",")] if key in ("pieces", "gaps")
                         else int(value) if key in ("chunks", "huge") else float(value))
        elif source == "input":
            words.append(word)
    spec["words"] = " ".join(words) if spec["heard"] is None else spec["heard"]
    return spec


def timeline(spec: dict, rate: int) -> tuple[list[int], list[float]]:
    """(sample bytes per chunk, seconds after ``first`` at which each chunk is sent)."""
    if spec["pieces"]:
        sizes = [int(round(p * rate)) * 2 for p in spec["pieces"]]
    else:
        total = int(round(spec["audio"] * rate)) * 2
        sizes = [total // spec["chunks"]] * spec["chunks"]
        sizes[-1] += total - sum(sizes)
    gaps = spec["gaps"] or [spec["gap"]]
    at, times = 0.0, []
    for i in range(len(sizes)):
        if i:
            at += gaps[min(i - 1, len(gaps) - 1)]
        times.append(at)
    return sizes, times


def spoken_bytes(words: str, size: int) -> bytes:
    """``size`` sample bytes that carry ``words`` (repeated, cut to the size)."""
    unit = b"TXT:" + words.encode() + b"\0"
    return (unit * (size // len(unit) + 1))[:size]


def transcribe(audio) -> str:
    """The words the samples carry (mono float32, as the bench hands a transcriber at 16 kHz)."""
    import numpy as np

    raw = np.round(np.asarray(audio, dtype=np.float64) * 32768.0).astype("<i2").tobytes()
    start = raw.find(b"TXT:")
    end = raw.find(b"\0", start + 4)
    return raw[start + 4:end].decode() if start >= 0 and end > 0 else ""


def embed(audio):
    """A stand-in speaker embedding: level, mean and peak of the clip."""
    import numpy as np

    a = np.asarray(audio, dtype=np.float64)
    return np.array([1.0, a.mean(), np.abs(a).max()])


class _Quiet(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        """A client that hung up (its deadline, a refused line) is what the misbehaving modes are for."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class SpeechServer:
    def __init__(self):
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.trickle_after: int | None = None  # requests after this many trickle, whatever their spec
        self.trickling = threading.Event()  # set once a trickling response has sent its first byte
        # vLLM-Omni's profiler endpoints (served when a stage has a profiler_config): 404 when off;
        # on_stop_profile() runs before /stop_profile answers, as the worker writes its trace.
        self.profiler = True
        self.on_stop_profile = None
        # input text -> the clock times its audio chunks were written (the last request with it): what a
        # loaded host really sent, beside the schedule asked for
        self.sent: dict[str, list[float]] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path in ("/start_profile", "/stop_profile"):
                    with server.lock:
                        server.requests.append({"path": self.path, **body})
                    if server.profiler and self.path == "/stop_profile" and server.on_stop_profile:
                        server.on_stop_profile()
                    msg = b'{"status": "SUCCESS"}' if server.profiler else b'{"detail": "Not Found"}'
                    self.send_response(200 if server.profiler else 404)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                with server.lock:
                    server.requests.append({"path": self.path, **body})
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                self.counted = True
                try:
                    self._speak(body)
                finally:
                    self._leave()

            def _leave(self):
                """Stop counting this request as in flight: called before the last bytes a client
                could take as the end, so its next request never overlaps this one in the count."""
                if self.counted:
                    self.counted = False
                    with server.lock:
                        server.in_flight -= 1

            def _chunk(self, data: bytes):
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _speak(self, body):
                spec = parse_spec(body["input"], body.get("ref_text") or "")
                with server.lock:
                    if server.trickle_after is not None and len(server.requests) > server.trickle_after:
                        spec["mode"] = "trickle"
                if spec["mode"] == "http500":
                    self._leave()
                    msg = b'{"error": "boom"}'
                    self.send_response(500)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                rate = int(body.get("sample_rate") or NATIVE_RATE)
                fmt = body.get("response_format", "wav")
                sse = body.get("stream_format") in (None, "sse")
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream" if sse else f"audio/{fmt}")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def emit(data: bytes):
                    if sse:
                        payload = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode(),
                                   "response_format": fmt}
                        self._chunk(f"event: speech.audio.delta\ndata: {json.dumps(payload)}\n\n".encode())
                    else:
                        self._chunk(data)

                if spec["mode"] in MISBEHAVIOURS:
                    self._leave()
                    try:
                        self._misbehave(spec, emit, rate)
                    except OSError:  # the client gave up (its deadline): expected
                        self.close_connection = True
                    return

                t0 = time.perf_counter()
                pieces, times = timeline(spec, rate)
                sent = server.sent.setdefault(body["input"], [])  # when each audio chunk left, in fact
                sent.clear()
                samples = spoken_bytes(spec["words"], sum(pieces))
                if fmt == "wav":
                    time.sleep(max(0.0, spec["header"] - (time.perf_counter() - t0)))
                    emit(wav_header(rate))
                at = 0
                for i, n in enumerate(pieces):
                    # the first samples at `first` from the request's start, each later chunk at its
                    # scheduled time from the first one's actual send: no drift, and a first chunk a
                    # loaded host sent late does not squeeze the rest of the stream together
                    due = spec["first"] if i == 0 else sent[0] - t0 + times[i]
                    time.sleep(max(0.0, due - (time.perf_counter() - t0)))
                    if spec["mode"] == "cut" and i == len(pieces) // 2:
                        self._leave()
                        self.wfile.write(b"400\r\npartial")  # a chunk that never completes
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    emit(samples[at:at + n])
                    sent.append(time.perf_counter())
                    at += n
                    if spec["mode"] == "error" and i == 0:
                        self._leave()
                        err = {"type": "speech.audio.error", "error": {
                            "message": "injected failure", "type": "server_error", "param": None, "code": 500,
                            "partial_audio": True, "action": "discard"}}
                        self._chunk(f"event: speech.audio.error\ndata: {json.dumps(err)}\n\n".encode())
                        self._chunk(b"")
                        return
                self._leave()
                if sse and spec["mode"] != "nodone":
                    done = {"type": "speech.audio.done", "usage": {"output_tokens": len(pieces)}}
                    self._chunk(f"event: speech.audio.done\ndata: {json.dumps(done)}\n\n".encode())
                self._chunk(b"")  # zero-length chunk: end of body

            def _misbehave(self, spec, emit, rate):
                mode = spec["mode"]
                if mode == "trickle":
                    self._chunk(b":")
                    server.trickling.set()
                    end = time.monotonic() + spec["trickle"]
                    while time.monotonic() < end:
                        time.sleep(0.05)
                        self._chunk(b"x")
                    self._chunk(b"\n\n")
                elif mode == "zerobits":
                    emit(wav_header(rate, bits=0) + b"\0" * 64)
                elif mode == "shortfmt":
                    emit(short_fmt_header(rate) + b"\0" * 64)
                elif mode == "hugeline":
                    self._chunk(b"data: ")
                    piece = b"A" * 65536
                    for _ in range(spec["huge"] // len(piece)):
                        self._chunk(piece)
                    self._chunk(b"\n\n")
                else:
                    event = {"badjson": "data: {not json\n\n", "notobject": "data: [1, 2]\n\n",
                             "numaudio": 'data: {"type": "speech.audio.delta", "audio": 12345}\n\n',
                             "strerror": 'data: {"type": "speech.audio.error", "error": "overloaded"}\n\n'}[mode]
                    emit(wav_header(rate))
                    self._chunk(event.encode())
                if mode in ("zerobits", "shortfmt"):
                    done = {"type": "speech.audio.done"}
                    self._chunk(f"event: speech.audio.done\ndata: {json.dumps(done)}\n\n".encode())
                self._chunk(b"")

        self.httpd = _Quiet(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
