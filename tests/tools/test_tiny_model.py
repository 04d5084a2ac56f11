"""``drama3-patches tiny-model``: the published-format checkpoint the rehearsal and the e2e tier run.

Read back with the safetensors header and vLLM-Omni's own config class: the depth asked for, the
dtypes of the routed experts (bfloat16, or block FP8 with one float32 scale per 128x128 block),
the published token ids, ten codebooks, and a codec.pth in the published DAC's shapes.
"""

from __future__ import annotations

import json
import struct

import pytest

from support.replicas import needs_fish_omni
from support.subproc import run_cli

pytestmark = [pytest.mark.vllm, needs_fish_omni]


def _header(path) -> dict:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return {k: v for k, v in json.loads(fh.read(n)).items() if k != "__metadata__"}


def test_published_depth_fp8_checkpoint_has_the_published_layout(tmp_path):
    out = tmp_path / "deep"
    done = run_cli("tiny-model", str(out), "--depth", "published", "--fp8", timeout=600)
    assert done.returncode == 0, done.stderr
    cfg = json.loads((out / "config.json").read_text())
    from vllm_omni.model_executor.models.fish_omni.configuration_fish_omni import FishOmniConfig

    hf = FishOmniConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    text, tower = hf.text_config, hf.audio_decoder_config
    assert text.num_hidden_layers == 40 and text.layer_types.count("full_attention") == 10
    assert (tower.num_codebooks, tower.shared_enrichment_layers) == (10, 4)
    assert (cfg["semantic_start_token_id"], cfg["eos_token_id"]) == (248099, 248046)
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    header = _header(out / "model.safetensors")
    experts = {k: v for k, v in header.items() if ".experts." in k}
    weights = [v for k, v in experts.items() if k.endswith(".weight")]
    scales = [v for k, v in experts.items() if k.endswith(".weight_scale_inv")]
    # 40 layers x 4 experts x 3 projections, each with its scale of one 128x128 block
    assert len(weights) == len(scales) == 40 * 4 * 3
    assert {w["dtype"] for w in weights} == {"F8_E4M3"} and {s["dtype"] for s in scales} == {"F32"}
    assert {tuple(s["shape"]) for s in scales} == {(1, 1)}
    # nine codebook layers after the four shared ones
    assert sum(k.startswith("audio_decoder_mtp.layers.") and k.endswith("eh_proj.weight") for k in header) == 9
    assert sum(k.startswith("audio_decoder_mtp_shared.layers.") and k.endswith("eh_proj.weight") for k in header) == 4
    import torch

    codec = torch.load(out / "codec.pth", weights_only=True)["generator"]
    assert sum(".quantizers." in k for k in codec) > 0 and all(".quantizers." in k for k in codec)
    assert (out / "tokenizer.json").is_file()


def test_tiny_bfloat16_checkpoint_is_seeded_and_refuses_a_used_folder(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        assert run_cli("tiny-model", str(d), timeout=600).returncode == 0
    header = _header(a / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if ".experts." in k} == {"BF16"}
    assert json.loads((a / "config.json").read_text())["text_config"]["num_hidden_layers"] == 4
    # the same seed writes the same bytes
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    again = run_cli("tiny-model", str(a))
    assert again.returncode == 2 and "exists and is not an empty folder" in again.stderr
