"""Word error rate over the transcripts of generated speech, scored by jiwer, and the transcribers.

Two methods share jiwer's word alignment and differ in text normalization and
in how the utterances are averaged:

``seed-tts-eval`` (default)
    What the benchmark's own scripts do (``run_wer.py``, ``average_wer.py``):
    remove ASCII and CJK punctuation except the apostrophe (removed, not turned
    into spaces), lower-case, score each utterance with jiwer, and report the
    mean of the per-utterance rates.
``whisper``
    Whisper's English text normalizer (spelled-out numbers to digits,
    contractions expanded, British spellings to American, fillers dropped),
    then jiwer over the corpus: all errors / all reference words.

Both aggregates are kept for either method, with every utterance's counts.

Transcribers turn mono float32 16 kHz audio into text. They load from a local
path only: openai-whisper (a ``.pt`` checkpoint file) or transformers (a model
folder, ``WhisperForConditionalGeneration`` as Seed-TTS-Eval runs it), with the
Hugging Face hub switched offline; or any ``MODULE:FUNCTION`` callable.
"""

from __future__ import annotations

import importlib.util
import os
import string
from dataclasses import asdict, dataclass, field

METHODS = ("seed-tts-eval", "whisper")
BACKENDS = ("auto", "transformers", "openai-whisper")

# zhon.hanzi.punctuation, which Seed-TTS-Eval removes beside string.punctuation:
# fullwidth ASCII variants, CJK brackets and stops, and the typographic dashes,
# quotes and ellipsis that English text also carries (so a curly apostrophe goes).
_CJK_PUNCTUATION = (
    "\uff02\uff03\uff04\uff05\uff06\uff07\uff08\uff09\uff0a\uff0b\uff0c\uff0d\uff0f\uff1a\uff1b\uff1c\uff1d\uff1e"
    "\uff20\uff3b\uff3c\uff3d\uff3e\uff3f\uff40\uff5b\uff5c\uff5d\uff5e\uff5f\uff60\uff62\uff63\uff64"
    "\u3000\u3001\u3003\u3008\u3009\u300a\u300b\u300c\u300d\u300e\u300f\u3010\u3011"
    "\u3014\u3015\u3016\u3017\u3018\u3019\u301a\u301b\u301c\u301d\u301e\u301f\u3030\u303e\u303f"
    "\u2013\u2014\u2018\u2019\u201b\u201c\u201d\u201e\u201f\u2026\u2027\ufe4f\ufe51\ufe54\u00b7"
    "\uff01\uff1f\uff61\u3002"
)
_SEED_DROP = {ord(ch): None for ch in string.punctuation + _CJK_PUNCTUATION if ch != "'"}


def normalize_seed_tts_eval(text: str) -> str:
    return " ".join(text.translate(_SEED_DROP).lower().split())


_whisper_normalizer = None


def normalize_whisper(text: str) -> str:
    global _whisper_normalizer
    if _whisper_normalizer is None:
        from whisper_normalizer.english import EnglishTextNormalizer

        _whisper_normalizer = EnglishTextNormalizer()
    return " ".join(_whisper_normalizer(text).split())


NORMALIZERS = {"seed-tts-eval": normalize_seed_tts_eval, "whisper": normalize_whisper}


@dataclass
class UttScore:
    utt: str
    reference: str
    hypothesis: str
    reference_normalized: str
    hypothesis_normalized: str
    hits: int = 0
    substitutions: int = 0
    deletions: int = 0
    insertions: int = 0

    @property
    def reference_words(self) -> int:
        return self.hits + self.substitutions + self.deletions

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def wer(self) -> float:
        return self.errors / self.reference_words

    def as_dict(self) -> dict:
        return asdict(self) | {"reference_words": self.reference_words, "wer": self.wer}


@dataclass
class WerScore:
    method: str
    utterances: list[UttScore] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"utt", "reason"}: not counted

    def _sum(self, name: str) -> int:
        return sum(getattr(u, name) for u in self.utterances)

    @property
    def corpus(self) -> float | None:
        words = self._sum("reference_words")
        return self._sum("errors") / words if words else None

    @property
    def utterance_mean(self) -> float | None:
        return sum(u.wer for u in self.utterances) / len(self.utterances) if self.utterances else None

    @property
    def value(self) -> float | None:
        """The method's headline figure."""
        return self.utterance_mean if self.method == "seed-tts-eval" else self.corpus

    def fields(self) -> dict:
        return {
            "wer": self.value, "wer_method": self.method, "wer_corpus": self.corpus,
            "wer_utterance_mean": self.utterance_mean, "wer_scored": len(self.utterances),
            **{f"wer_{k}": self._sum(k) for k in ("hits", "substitutions", "deletions", "insertions",
                                                 "reference_words")},
            "wer_utterances": [u.as_dict() for u in self.utterances], "wer_skipped": self.skipped,
        }


def score(pairs, method: str = "seed-tts-eval") -> WerScore:
    """``pairs``: (utt, reference text, transcript) triples; jiwer aligns each normalized pair."""
    import jiwer

    norm = NORMALIZERS[method]
    result = WerScore(method)
    for utt, ref, hyp in pairs:
        r, h = norm(ref), norm(hyp)
        if not r:  # jiwer refuses an empty reference: nothing to be wrong about
            result.skipped.append({"utt": utt, "reason": f"reference is empty after {method} normalization"})
            continue
        result.utterances.append(UttScore(utt, ref, hyp, r, h))
    if not result.utterances:
        return result
    out = jiwer.process_words([u.reference_normalized for u in result.utterances],
                              [u.hypothesis_normalized for u in result.utterances])
    for u, chunks in zip(result.utterances, out.alignments):
        for c in chunks:
            if c.type == "equal":
                u.hits += c.ref_end_idx - c.ref_start_idx
            elif c.type == "substitute":
                u.substitutions += c.ref_end_idx - c.ref_start_idx
            elif c.type == "delete":
                u.deletions += c.ref_end_idx - c.ref_start_idx
            elif c.type == "insert":
                u.insertions += c.hyp_end_idx - c.hyp_start_idx
    return result


def unavailable(method: str, whisper_path: str | None, transcriber: str | None) -> str | None:
    """Why WER cannot be computed, or None when it can."""
    if importlib.util.find_spec("jiwer") is None:
        return "jiwer is not installed (pip install jiwer)"
    if method == "whisper" and importlib.util.find_spec("whisper_normalizer") is None:
        return "whisper-normalizer is not installed (pip install whisper-normalizer)"
    if transcriber:
        return None
    if not whisper_path:
        return "no --whisper model path given"
    if not os.path.exists(whisper_path):
        return f"{whisper_path} does not exist (models are never downloaded)"
    return None


def _offline() -> None:
    # A local path must never turn into a hub download, whatever the caller's environment says.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_transcriber(whisper_path: str | None = None, backend: str = "auto", transcriber: str | None = None):
    """(transcribe(audio16k) -> str, description); raises ValueError with the reason it cannot."""
    if transcriber:
        from drama3_patches.tools.bench.audio import import_callable

        return import_callable(transcriber), f"{transcriber} (plug-in)"
    path = whisper_path or ""
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist (models are never downloaded)")
    if backend == "auto":
        backend = "openai-whisper" if os.path.isfile(path) else "transformers"
    if backend == "openai-whisper":
        if not os.path.isfile(path):
            raise ValueError(f"{path}: openai-whisper loads a .pt checkpoint file, not a folder")
        if importlib.util.find_spec("whisper") is None:
            raise ValueError("openai-whisper is not installed (pip install openai-whisper)")
        import whisper  # a file path loads as is; only a bare model name would download

        device = _device()
        model = whisper.load_model(path, device=device)

        def transcribe(audio) -> str:
            # fp16 only where it runs (CUDA); on CPU whisper would warn and fall back each call.
            return model.transcribe(audio, language="en", task="transcribe", fp16=device == "cuda")["text"]

        return transcribe, f"openai-whisper {path}"
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path}: not a transformers model folder (no config.json)")
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("transformers is not installed (pip install transformers)")
    _offline()
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    device = _device()
    processor = WhisperProcessor.from_pretrained(path, local_files_only=True)
    model = WhisperForConditionalGeneration.from_pretrained(path, local_files_only=True).to(device).eval()

    def transcribe(audio) -> str:
        feats = processor(audio, sampling_rate=16000, return_tensors="pt").input_features.to(device, model.dtype)
        with torch.no_grad():
            ids = model.generate(feats, language="english", task="transcribe")
        return processor.batch_decode(ids, skip_special_tokens=True)[0]

    return transcribe, f"transformers Whisper {path}"
