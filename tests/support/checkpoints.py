"""The Qwen3-Next-layout checkpoints of `plan`'s tests (block-FP8 experts, written by hand with the
product's safetensors writer); Drama 3's published format is the product's own generator,
``drama3_patches.tools.tiny_model``.

`python tests/support/checkpoints.py DIR` writes a fish_omni checkpoint of the published class's
shape (sparse files: only the headers take disk space) for `drama3-patches plan DIR`;
`--qwen3-next` writes the older Qwen3-Next stand-in; `--published-codec` gives codec.pth the published
DAC's shapes (for `plan --time`'s stage 1; needs vllm-omni).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from drama3_patches.tools.tiny_model import DRAMA3_CFG, INDEX_FILE, write_fish_checkpoint, write_safetensors

# A small Qwen3-Next-shaped model: 4 layers, every 2nd full attention, 8 block-FP8 experts.
CFG = dict(
    model_type="qwen3_next", hidden_size=256, num_hidden_layers=4, full_attention_interval=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
    linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
    vocab_size=1000, torch_dtype="bfloat16",
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
)


def tensor_specs(cfg=CFG):
    """(name, dtype, shape) of every tensor, with Qwen3-Next checkpoint names."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    E, I, SI = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    b = 128
    out = [("model.embed_tokens.weight", "BF16", (V, H)), ("lm_head.weight", "BF16", (V, H)),
           ("model.norm.weight", "BF16", (H,))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", "BF16", (H,)), (p + "post_attention_layernorm.weight", "BF16", (H,))]
        if (i + 1) % cfg["full_attention_interval"] == 0:
            a = p + "self_attn."
            out += [(a + "q_proj.weight", "BF16", (nh * hd * 2, H)), (a + "k_proj.weight", "BF16", (kv * hd, H)),
                    (a + "v_proj.weight", "BF16", (kv * hd, H)), (a + "o_proj.weight", "BF16", (H, nh * hd)),
                    (a + "q_norm.weight", "BF16", (hd,)), (a + "k_norm.weight", "BF16", (hd,))]
        else:
            a = p + "linear_attn."
            out += [(a + "in_proj_qkvz.weight", "BF16", (2 * nk * dk + 2 * nv * dv, H)),
                    (a + "in_proj_ba.weight", "BF16", (2 * nv, H)),
                    (a + "conv1d.weight", "BF16", (2 * nk * dk + nv * dv, 1, K)),
                    (a + "A_log", "F32", (nv,)), (a + "dt_bias", "BF16", (nv,)), (a + "norm.weight", "F32", (dv,)),
                    (a + "out_proj.weight", "BF16", (H, nv * dv))]
        m = p + "mlp."
        out += [(m + "gate.weight", "BF16", (E, H)), (m + "shared_expert_gate.weight", "BF16", (1, H)),
                (m + "shared_expert.gate_proj.weight", "BF16", (SI, H)),
                (m + "shared_expert.up_proj.weight", "BF16", (SI, H)),
                (m + "shared_expert.down_proj.weight", "BF16", (H, SI))]
        for e in range(E):
            x = f"{m}experts.{e}."
            for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                out += [(x + proj + ".weight", "F8_E4M3", shape),
                        (x + proj + ".weight_scale_inv", "F32", (-(-shape[0] // b), -(-shape[1] // b)))]
    return out


def write_checkpoint(d: Path, cfg=CFG, shards=1, sparse=False):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    specs = tensor_specs(cfg)
    if shards == 1:
        return write_safetensors(d / "model.safetensors", specs, sparse)
    per = -(-len(specs) // shards)
    weight_map, total = {}, 0
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = specs[k * per:(k + 1) * per]
        total += write_safetensors(d / fname, part, sparse)
        weight_map.update({name: fname for name, _, _ in part})
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


# Drama 3's config.json is not public: a stand-in of its class (Qwen3-Next layout, 48 layers,
# 128 block-FP8 experts of 768 x 2048), used for the plan figures in docs/recipe.md.
STANDIN_CFG = dict(CFG, hidden_size=2048, num_hidden_layers=48, full_attention_interval=4, num_attention_heads=16,
                   num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                   linear_key_head_dim=128, linear_value_head_dim=128, num_experts=128, moe_intermediate_size=768,
                   shared_expert_intermediate_size=768, vocab_size=151936)


def write_published_codec_shapes(path: Path) -> bool:
    """codec.pth with the published DAC's every tensor at its shape (vLLM-Omni's ``build_dac_codec`` on
    the meta device), each a one-element tensor expanded: the file is kilobytes, torch.load gives the
    shapes `plan --time` times stage 1 from. False where vLLM-Omni's DAC cannot be built here."""
    try:
        import torch
        from vllm_omni.model_executor.models.fish_speech.dac_utils import build_dac_codec
    except ImportError:
        return False
    with torch.device("meta"):
        codec = build_dac_codec()
    state = {name: torch.zeros((), dtype=t.dtype).expand(t.shape) for name, t in codec.state_dict().items()}
    torch.save({"generator": state}, str(path))
    return True


if __name__ == "__main__":
    flags = set(sys.argv[2:])
    if len(sys.argv) < 2 or not flags <= {"--qwen3-next", "--published-codec"}:
        sys.exit("usage: python tests/support/checkpoints.py DIR [--qwen3-next | --published-codec]")
    if "--qwen3-next" in flags:
        write_checkpoint(Path(sys.argv[1]), STANDIN_CFG, shards=4, sparse=True)
        print(f"wrote a sparse Qwen3-Next stand-in checkpoint to {sys.argv[1]}")
    else:
        write_fish_checkpoint(Path(sys.argv[1]), DRAMA3_CFG, shards=4, sparse=True)
        if "--published-codec" in flags and not write_published_codec_shapes(Path(sys.argv[1]) / "codec.pth"):
            sys.exit("--published-codec: the published DAC's shapes come from vllm-omni's build_dac_codec; "
                     "run with the Python that has vllm-omni")
        print(f"wrote a sparse fish_omni checkpoint of the published class's shape to {sys.argv[1]}")
