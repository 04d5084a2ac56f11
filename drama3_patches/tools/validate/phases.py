"""The requests a validation sends, phase by phase, through the streaming speech API.

Every request is a voice clone (a reference clip and its transcript, as Seed-TTS-Eval sends
them) streamed as WAV over SSE by the benchmark's own client (``bench.speech.speak``), which
bounds each request in time and never raises for what a server does.
"""

from __future__ import annotations

import threading
import time
import wave
from dataclasses import dataclass, field

CODEC_RATE = 44100  # Drama 3's DAC: 44.1 kHz
FRAME_SAMPLES = 2048  # samples per frame (one step of stage 0)
# Phase c's text: with the tiny model's byte tokenizer a clone of it with a 1 s reference is about
# 220 prompt rows, so 48 frames carry it past a 256-token KV block (stage 0's hybrid block at TP2).
PREEMPT_TEXT = "a line long enough to fill most of one cache block."


def tone(seconds: float, seed: int):
    """A reference clip at the codec's rate: two tones and a little noise (no resampling needed)."""
    import numpy as np

    t = np.arange(int(seconds * CODEC_RATE)) / CODEC_RATE
    noise = np.random.default_rng(seed).standard_normal(t.size)
    wave_ = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * (330 + 20 * seed) * t) + 0.02 * noise
    return wave_.astype(np.float32)


def write_wav(target, samples: bytes, rate: int, channels: int = 1, bits: int = 16) -> None:
    """A WAV file at ``target``: a path, or a file object open for writing in binary."""
    with wave.open(target if hasattr(target, "write") else str(target), "wb") as fh:
        fh.setnchannels(channels)
        fh.setsampwidth(bits // 8)
        fh.setframerate(rate)
        fh.writeframes(samples)


def write_references(folder, count: int, seconds: float = 1.0) -> list:
    """``count`` voice-clone lines (``bench.speech.MetaLine``) with references written to ``folder``
    (an ``outdir.OutFolder``: each file new, through its descriptor)."""
    import numpy as np

    from drama3_patches.tools.bench.speech import MetaLine

    lines = []
    for i in range(count):
        path = folder / f"ref{i}.wav"
        with folder.open_new(f"ref{i}.wav") as fh:
            write_wav(fh, (tone(seconds, i) * 32767).astype(np.int16).tobytes(), CODEC_RATE)
        lines.append(MetaLine(f"line{i}", f"a short reference number {i}", str(path),
                              f"Line {i} of the validation, spoken in the cloned voice."))
    return lines


@dataclass
class Sent:
    """One request of a phase and what came back."""

    name: str
    result: object  # bench.speech.Result
    frames_asked: int

    @property
    def samples(self) -> int:
        r = self.result
        return int(round(r.audio_s * (r.sample_rate or 0))) if r.ok else 0

    def problem(self) -> str | None:
        """Why this request does not count as complete in whole 44.1 kHz frames, or None."""
        r = self.result
        if not r.ok:
            return f"{self.name}: {r.error}"
        if (r.sample_rate, r.channels) != (CODEC_RATE, 1):
            return f"{self.name}: {r.sample_rate} Hz x {r.channels} channel(s), not {CODEC_RATE} Hz mono"
        if self.samples % FRAME_SAMPLES or not 0 < self.samples // FRAME_SAMPLES <= self.frames_asked:
            return (f"{self.name}: {self.samples} samples: not a whole number of {FRAME_SAMPLES}-sample frames "
                    f"between 1 and {self.frames_asked}")
        return None


@dataclass
class Phase:
    sent: list = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def problems(self) -> list[str]:
        return [p for p in (s.problem() for s in self.sent) if p]

    @property
    def completed(self) -> int:
        return sum(s.problem() is None for s in self.sent)

    def overlaps(self) -> int:
        """Requests that arrived while an earlier one was still streaming (its prefill beside their decode)."""
        ordered = sorted(self.sent, key=lambda s: s.result.start)
        return sum(any(o.result.start < s.result.start < o.result.end for o in ordered[:i])
                   for i, s in enumerate(ordered))


def send(url: str, lines: list, *, frames: int, seed: int | None, stagger: float, timeout: float,
         keep_audio: bool = True) -> Phase:
    """Send one request per line, the i-th ``i * stagger`` seconds after the first; wait for all."""
    from drama3_patches.tools.bench.speech import Settings, speak_kept

    extra = {"max_new_tokens": frames}
    results: list = [None] * len(lines)

    def one(i, line):
        time.sleep(i * stagger)
        settings = Settings(url=url, timeout=timeout, keep_audio=keep_audio,
                            extra=dict(extra, **({} if seed is None else {"seed": seed + i})))
        results[i] = speak_kept(line, settings)

    began = time.monotonic()
    threads = [threading.Thread(target=one, args=(i, line), daemon=True) for i, line in enumerate(lines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    phase = Phase(wall_s=time.monotonic() - began)
    phase.sent = [Sent(line.utt, r, frames) for line, r in zip(lines, results)]
    return phase


def save_audio(phase: Phase, folder, prefix: str) -> list[str]:
    """Each completed request's samples as ``folder/<prefix>-<name>.wav`` (``folder`` an
    ``outdir.OutFolder``: each file new, through its descriptor); the paths written."""
    written = []
    for s in phase.sent:
        r = s.result
        if r.ok and r.audio:
            path = folder / f"{prefix}-{s.name}.wav"
            with folder.open_new(path.name) as fh:
                write_wav(fh, r.audio, r.sample_rate, r.channels, r.bits)
            written.append(str(path))
    return written


def bench_levels(url: str, lines: list, levels: list[int], timeout: float) -> list[dict]:
    """``drama3-patches bench``'s figures, one level per concurrency (no warm-up: the phases before warmed it)."""
    from drama3_patches.tools.bench.speech import Settings, run_level

    settings = Settings(url=url, timeout=timeout)
    return [run_level(lines, c, settings).result() for c in levels]
