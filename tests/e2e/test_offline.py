"""vLLM-Omni 0.32.0rc1's own offline engine (``Omni``) runs Drama 3's both stages on CPU with
the patches: plain TTS, a voice clone through the DAC encoder, a seeded request twice (the
tier's shared engine, conftest.npu_engine); and without the patches it fails at the model's first
Triton launch (the positive control, an engine of its own).

Each engine runs in a fresh interpreter (support.subproc.call): its stages are processes of
their own, started by vLLM-Omni.
"""

from __future__ import annotations

import pytest

from support import e2e_pipeline as ep
from support.subproc import ChildFailed, call

pytestmark = pytest.mark.e2e


def _audio_checks(out):
    assert out["sample_rate"] == ep.CODEC_SAMPLE_RATE
    assert 0 < out["frames"] <= ep.MAX_FRAMES, out
    # the DAC decodes 2048 samples per frame: the audio is exactly what the frames imply
    assert out["samples"] == out["frames"] * ep.CODEC_HOP, out
    assert out["finite"] and out["rms"] > 0, out


def test_offline_tts_voice_clone_and_seeded_repeat(npu_engine):
    phases = npu_engine["phases"]
    plain, clone = phases["tts_and_clone"]["outputs"]
    (seeded,), (again,) = phases["seeded"]["outputs"], phases["seeded_again"]["outputs"]
    for out in (plain, clone, seeded, again):
        _audio_checks(out)
    # the 1 s reference went through the DAC encoder: 22 frames of 10 codes in the clone's prompt
    assert "frames=22 codebooks=10" in npu_engine["log"], "the DAC encoder did not encode the reference"
    assert clone["prompt_rows"] > plain["prompt_rows"] + 22
    # the same seed gives the same frames: their count and the audio the DAC decodes from them
    assert (seeded["frames"], seeded["sha256"]) == (again["frames"], again["sha256"])
    assert seeded["sha256"] != plain["sha256"]
    applied = ep.applied_patches(npu_engine["reports"])
    assert "tower-sampler-eager" in applied, applied


def test_without_patches_the_model_fails_at_its_triton_launch(model_dir, tmp_path):
    deploy = ep.write_deploy(tmp_path / "deploy.yaml")
    with pytest.raises(ChildFailed) as failed:
        call(ep.offline_child, model_dir, str(deploy), [ep.SEEDED], env=ep.env(patches=False),
             pythonpath=[ep.SITE], timeout=900)
    output = failed.value.proc.stdout + failed.value.proc.stderr
    assert "TritonLaunchRefused: Triton launch of vllm_omni.model_executor.models.fish_omni.kernels." in output
