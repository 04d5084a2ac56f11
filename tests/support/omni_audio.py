"""vLLM-Omni's audio series as its published code defines and renders them (run in a fresh
interpreter through ``support.subproc.call``).

``vllm_omni/metrics/modality.py`` declares the families at import and observes them through
``OmniModalityMetrics``. Its package's ``__init__`` imports vLLM and torch (tens of seconds on a
loaded host) and nothing the families need, so the two package modules are stood in by bare
packages over the installed folders: the family modules themselves are the installed files.
"""

from __future__ import annotations

# (stage, replica, ttfp s, rtf, underrun s, frames): requests of a Drama 3 service, stage 1 (the
# codec) making the audio. Underruns straddle the 0.5 s cushion: 2 of 6 above it in the first
# round, 3 of 4 in the second.
ROUNDS = [
    [("1", "0", 0.9, 0.6, 0.0, 88200), ("1", "0", 1.4, 0.7, 0.2, 132300), ("1", "0", 2.1, 0.8, 0.7, 44100),
     ("1", "0", 0.8, 0.5, 0.05, 88200), ("1", "0", 3.0, 1.1, 1.6, 176400), ("1", "0", 1.1, 0.6, 0.3, 88200)],
    [("1", "0", 4.0, 1.3, 2.2, 88200), ("1", "0", 3.5, 1.2, 0.9, 88200), ("1", "0", 1.0, 0.6, 0.1, 44100),
     ("1", "0", 2.8, 1.0, 0.6, 132300)],
]
MODEL = "drama3"


def _load_modality():
    import importlib
    import importlib.util
    import os
    import sys
    import types

    if "vllm_omni.metrics.modality" in sys.modules:
        return sys.modules["vllm_omni.metrics.modality"]
    top = importlib.util.find_spec("vllm_omni").submodule_search_locations[0]
    for name, folder in (("vllm_omni", top), ("vllm_omni.metrics", os.path.join(top, "metrics"))):
        package = types.ModuleType(name)
        package.__path__ = [folder]
        sys.modules[name] = package
    return importlib.import_module("vllm_omni.metrics.modality")


def published_families() -> dict:
    """Every audio/speech sample name the installed modality module's families expose, with its
    label names, and the installed vLLM-Omni's version and the module's file."""
    import importlib.metadata

    modality = _load_modality()
    from prometheus_client import Counter, Histogram

    out: dict = {}
    for value in vars(modality).values():
        if isinstance(value, (Counter, Histogram)):
            suffixes = ("_bucket", "_sum", "_count", "_created") if isinstance(value, Histogram) else ("_total",
                                                                                                      "_created")
            for suffix in suffixes:
                labels = list(value._labelnames) + (["le"] if suffix == "_bucket" else [])
                out[value._name + suffix] = labels
    return {"families": out, "version": importlib.metadata.version("vllm-omni"), "file": modality.__file__}


def published_pages() -> list[str]:
    """The text-format pages prometheus_client renders after each round of ROUNDS, observed
    through the published ``OmniModalityMetrics`` (with one completed stream per request and
    an aborted stream in the second round)."""
    from prometheus_client import REGISTRY, generate_latest

    modality = _load_modality()
    metrics = modality.OmniModalityMetrics(MODEL)
    pages = []
    for i, requests in enumerate(ROUNDS):
        for stage, replica, ttfp, rtf, underrun, frames in requests:
            metrics.observe_audio_ttfp(stage, replica, ttfp)
            metrics.observe_audio_rtf(stage, replica, rtf)
            metrics.observe_audio_underrun(stage, replica, underrun)
            metrics.inc_audio_frames(stage, replica, frames)
            metrics.inc_speech_stream_completed()
        if i:
            metrics.inc_speech_stream_aborted("cancelled")
        pages.append(generate_latest(REGISTRY).decode())
    return pages
