"""vLLM-Omni 0.32.0rc1's own offline engine (``Omni``) runs Drama 3's both stages on CPU with
the patches: plain TTS, a voice clone through the DAC encoder, a seeded request twice; and
without the patches it fails at the model's first Triton launch (the positive control).

Each engine runs in a fresh interpreter (support.subproc.call): its stages are processes of
their own, started by vLLM-Omni.
"""

from __future__ import annotations

import json

import pytest

from support import e2e_pipeline as ep
from support.subproc import ChildFailed, call

pytestmark = pytest.mark.e2e

TEXT = "Hello from the end to end tier."
MAX_FRAMES = 8
PHASES = [
    {"max_tokens": MAX_FRAMES, "requests": [{"text": TEXT}, {"text": TEXT, "ref": 1.0}]},
    {"max_tokens": MAX_FRAMES, "seed": 1234, "requests": [{"text": "The same words, twice."}]},
    {"max_tokens": MAX_FRAMES, "seed": 1234, "requests": [{"text": "The same words, twice."}]},
]


def _audio_checks(out):
    assert out["sample_rate"] == ep.CODEC_SAMPLE_RATE
    assert 0 < out["frames"] <= MAX_FRAMES, out
    # the DAC decodes 2048 samples per frame: the audio is exactly what the frames imply
    assert out["samples"] == out["frames"] * ep.CODEC_HOP, out
    assert out["finite"] and out["rms"] > 0, out


def test_offline_tts_voice_clone_and_seeded_repeat(model_dir, tmp_path):
    deploy = ep.write_deploy(tmp_path / "deploy.yaml")
    reports = tmp_path / "reports"
    run = call(ep.offline_child, model_dir, str(deploy), PHASES, env=ep.env(report_dir=reports),
               pythonpath=[ep.SITE], timeout=900, with_output=True)
    result, log = run["result"], run["output"]
    print(json.dumps(result, indent=1))
    (plain, clone), (seeded,), (again,) = (p["outputs"] for p in result["phases"])
    for out in (plain, clone, seeded, again):
        _audio_checks(out)
    # the 1 s reference went through the DAC encoder: 22 frames of 10 codes in the clone's prompt
    assert "frames=22 codebooks=10" in log, "the DAC encoder did not encode the reference"
    assert clone["prompt_rows"] > plain["prompt_rows"] + 22
    # the same seed gives the same frames: their count and the audio the DAC decodes from them
    assert (seeded["frames"], seeded["sha256"]) == (again["frames"], again["sha256"])
    assert seeded["sha256"] != plain["sha256"]
    applied = ep.applied_patches(reports)
    assert "tower-sampler-eager" in applied, applied


def test_without_patches_the_model_fails_at_its_triton_launch(model_dir, tmp_path):
    deploy = ep.write_deploy(tmp_path / "deploy.yaml")
    with pytest.raises(ChildFailed) as failed:
        call(ep.offline_child, model_dir, str(deploy), PHASES[1:2], env=ep.env(patches=False),
             pythonpath=[ep.SITE], timeout=900)
    output = failed.value.proc.stdout + failed.value.proc.stderr
    assert "TritonLaunchRefused: Triton launch of vllm_omni.model_executor.models.fish_omni.kernels." in output
