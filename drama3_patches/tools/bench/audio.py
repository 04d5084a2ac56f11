"""Audio plumbing shared by the WER and SIM scorers: 16-bit PCM to float, 16 kHz, wav files, plug-ins.

Both Seed-TTS-Eval models (Whisper for WER, WavLM for SIM) take mono 16 kHz
float audio, so every clip is brought there once, here.
"""

from __future__ import annotations

import importlib
import wave

MODEL_RATE = 16000


def pcm16_to_float(pcm: bytes, channels: int = 1):
    """Little-endian 16-bit PCM to a mono float32 array in [-1, 1) (channels averaged)."""
    import numpy as np

    audio = np.frombuffer(pcm[: len(pcm) - len(pcm) % (2 * channels)], dtype="<i2").astype(np.float32) / 32768.0
    if channels > 1:
        audio = audio.reshape(-1, channels).mean(axis=1)
    return audio


def resample(audio, rate: int, new_rate: int = MODEL_RATE):
    """FFT resampling, the method of ``scipy.signal.resample`` that Seed-TTS-Eval calls before Whisper.

    Written with numpy so that scoring needs no scipy; the Nyquist bin of an even
    length is split or joined as scipy does.
    """
    import numpy as np

    n = len(audio)
    if rate == new_rate or n == 0:
        return np.asarray(audio, dtype=np.float32)
    num = int(n * new_rate / rate)
    spec = np.fft.rfft(np.asarray(audio, dtype=np.float64))
    out = np.zeros(num // 2 + 1, dtype=spec.dtype)
    m = min(num, n)
    keep = m // 2 + 1
    out[:keep] = spec[:keep]
    if m % 2 == 0:
        out[m // 2] *= 2.0 if num < n else 0.5 if num > n else 1.0
    return (np.fft.irfft(out, num) * (num / n)).astype(np.float32)


def to_model_rate(pcm: bytes, rate: int, channels: int = 1):
    return resample(pcm16_to_float(pcm, channels), rate)


def read_wav(path: str):
    """(mono float32 audio, rate) of a 16-bit PCM wav; soundfile, when installed, reads other formats."""
    try:
        with wave.open(path, "rb") as w:
            if w.getsampwidth() != 2:
                raise wave.Error(f"{w.getsampwidth() * 8}-bit samples")
            return pcm16_to_float(w.readframes(w.getnframes()), w.getnchannels()), w.getframerate()
    except (wave.Error, EOFError) as exc:
        try:
            import soundfile
        except ImportError:
            raise ValueError(f"{path}: not 16-bit PCM wav ({exc}); install soundfile to read it") from None
        data, rate = soundfile.read(path, dtype="float32", always_2d=True)
        return data[:, 0], rate  # first channel, as Seed-TTS-Eval's speaker check takes it


def import_callable(spec: str):
    """``package.module:function`` -> the function; a plug-in transcriber or speaker embedder."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{spec!r}: expected MODULE:FUNCTION (for example mypkg.asr:transcribe)")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"{spec!r}: cannot import {module}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{spec!r}: {module} has no {attr}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec!r}: {attr} is not callable")
    return obj
