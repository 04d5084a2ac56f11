"""Speaker similarity (SIM): cosine similarity of speaker embeddings, generated speech vs its prompt.

Seed-TTS-Eval embeds both clips (first channel, resampled to 16 kHz) with
WavLM-large fine-tuned for speaker verification under an ECAPA-TDNN head
(UniSpeech's ``wavlm_large_finetune.pth``) and averages the cosine over the
utterances. That checkpoint needs UniSpeech's model code, so it plugs in as a
``MODULE:FUNCTION`` embedder (mono float32 16 kHz audio -> 1-D embedding).
A local transformers ``WavLMForXVector`` folder also loads; its x-vector head
is a different model, so its SIM is not comparable with the benchmark's.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field


@dataclass
class SimScore:
    utterances: list[dict] = field(default_factory=list)  # {"utt", "sim"}
    skipped: list[dict] = field(default_factory=list)  # {"utt", "reason"}

    @property
    def value(self) -> float | None:
        return sum(u["sim"] for u in self.utterances) / len(self.utterances) if self.utterances else None

    def fields(self) -> dict:
        return {"sim": self.value, "sim_scored": len(self.utterances), "sim_utterances": self.utterances,
                "sim_skipped": self.skipped}


def cosine(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"embeddings differ in size ({a.size} vs {b.size})")
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        raise ValueError("zero embedding")
    return float(np.dot(a, b) / (na * nb))


class Scorer:
    """Embeds each prompt once (every concurrency level reuses it) and each generated clip."""

    def __init__(self, embed):
        self.embed = embed
        self.prompts: dict[str, object] = {}

    def prompt_embedding(self, path: str):
        if path not in self.prompts:
            from drama3_patches.tools.bench.audio import read_wav, resample

            audio, rate = read_wav(path)
            self.prompts[path] = self.embed(resample(audio, rate))
        return self.prompts[path]

    def add(self, result: SimScore, utt: str, audio, prompt: str) -> bool:
        """Score one generated clip (mono 16 kHz) against its prompt wav into ``result``."""
        try:
            sim = cosine(self.embed(audio), self.prompt_embedding(prompt))
        except Exception as exc:  # one bad clip is reported, the others still count
            result.skipped.append({"utt": utt, "reason": f"{type(exc).__name__}: {exc}"})
            return False
        result.utterances.append({"utt": utt, "sim": sim})
        return True

    def score(self, items) -> SimScore:
        """``items``: (utt, generated mono 16 kHz audio, prompt wav path)."""
        result = SimScore()
        for utt, audio, prompt in items:
            self.add(result, utt, audio, prompt)
        return result


def unavailable(model_path: str | None, embedder: str | None) -> str | None:
    if embedder:
        return None
    if not model_path:
        return "no --sim-model or --sim-embedder given"
    if not os.path.exists(model_path):
        return f"{model_path} does not exist (models are never downloaded)"
    return None


def load_embedder(model_path: str | None = None, embedder: str | None = None):
    """(embed(audio16k) -> vector, description); raises ValueError with the reason it cannot."""
    if embedder:
        from drama3_patches.tools.bench.audio import import_callable

        return import_callable(embedder), f"{embedder} (plug-in)"
    path = model_path or ""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path}: not a transformers model folder (no config.json)")
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("transformers is not installed (pip install transformers)")
    os.environ["HF_HUB_OFFLINE"] = "1"  # a local folder only, never the hub
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    from transformers import AutoFeatureExtractor, WavLMForXVector

    extractor = AutoFeatureExtractor.from_pretrained(path, local_files_only=True)
    model = WavLMForXVector.from_pretrained(path, local_files_only=True).eval()

    def embed(audio):
        inputs = extractor(audio, sampling_rate=16000, return_tensors="pt")
        with torch.no_grad():
            return model(**inputs).embeddings[0].float().numpy()

    return embed, (f"transformers WavLMForXVector {path} (not Seed-TTS-Eval's WavLM-large ECAPA-TDNN: "
                   "not comparable with its SIM)")
