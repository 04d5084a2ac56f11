"""``drama3-patches tiny-model DIR``: a tiny Drama 3 checkpoint in the published format.

vLLM-Omni 0.32.0rc1's ``fish_omni`` loads it as it loads ``fishaudio/drama-3``: a FishOmniConfig
``config.json`` (Qwen3.5-MoE backbone under ``model.language_model.``, the codebook tower under
``audio_decoder*``, ``lm_head`` at the top), safetensors written by hand with seeded values, the
tokenizer files (the published special-token and semantic ids), ten codebooks and a
``codec.pth`` in the published DAC's shapes. What it is for: rehearsing a deployment
(``drama3-patches validate`` makes one when no ``--model`` is given), the e2e tests, and start-up
on the cards without the 37 GB download. Its audio is noise: the weights are random.

Two depths: ``tiny`` (4 backbone layers, 1 shared + 9 tower layers: the fastest run) and
``published`` (40 layers, 30 GDN + 10 full attention, all MoE; 4 shared + 9 tower layers: every
per-layer cost of the real model, at a tiny width). ``--fp8`` writes the routed experts in block
FP8 with their scales, as the published checkpoint keeps them (the 910B expansion path); CPU runs
need bfloat16 experts (vLLM has no CPU MoE method for block FP8).

Without ``seed`` the writers also make sparse files of any shape (only the headers take disk
space): ``plan`` reads those.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
SIZES = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
# A block-FP8 expert weight is drawn at unit scale (FP8's grid is coarse near 0.02) and its
# per-block inverse scale is this constant: dequantized, the weights have the bfloat16 draw's spread.
FP8_SCALE = 0.02


def seeded_values(name: str, dtype: str, shape, seed: int) -> bytes:
    """Deterministic random bytes of one tensor: a normal draw (std 0.02; block-FP8 weights at unit
    scale, their scales FP8_SCALE) seeded by ``seed`` and the tensor's name, so a checkpoint's
    values do not depend on the order it is written in."""
    import zlib

    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("weight_scale_inv"):
        values = torch.full(tuple(shape), FP8_SCALE)
    else:
        values = torch.randn(tuple(shape), generator=generator) * (1.0 if dtype == "F8_E4M3" else 0.02)
    torch_dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}[dtype]
    return values.to(torch_dtype).contiguous().view(torch.uint8).numpy().tobytes()


def write_safetensors(path: Path, specs, sparse=False, seed=None):
    """The safetensors format by hand: u64 header length, JSON header, then the data
    (seeded real values with ``seed``, else a filler nothing may read)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in specs:
        n = math.prod(shape) * SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        if sparse:
            fh.truncate(8 + len(raw) + offset)
        elif seed is not None:
            for name, dtype, shape in specs:
                fh.write(seeded_values(name, dtype, shape, seed))
        else:
            fh.write(b"\x11" * offset)  # not zeros: nothing here may be read anyway
    return 8 + len(raw)


# ---------------------------------------------------------------------------------------------
# Drama 3 in its published format: vLLM-Omni 0.32.0rc1's fish_omni (FishOmniConfig config.json,
# Qwen3.5-MoE backbone under model.language_model., the codebook tower under audio_decoder*,
# lm_head at the top, block-FP8 routed experts; the DAC codec in codec.pth).
# Every spec carries its role, so tests sum bytes by role instead of re-deriving names.
# ---------------------------------------------------------------------------------------------

FISH_TEXT = dict(
    model_type="qwen3_5_moe_text", hidden_size=256, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    mlp_layer_types=["moe"] * 4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
    shared_expert_intermediate_size=256, vocab_size=1024,
)
FISH_DECODER = dict(dim=256, n_head=4, n_local_heads=2, head_dim=64, intermediate_size=512, num_codebooks=4,
                    vocab_size=64, shared_enrichment_layers=2, vq_backbone_codebooks=1)
FISH_CFG = dict(
    model_type="fish_omni", architectures=["FishOmniForConditionalGeneration"], dtype="bfloat16",
    text_config=FISH_TEXT, audio_decoder_config=FISH_DECODER,
    # 63 semantic codes after code 0, plus end of speech: 64 lm_head rows are kept.
    semantic_start_token_id=896, semantic_end_token_id=959, audio_pad_token_id=960, eos_token_id=1000,
    quantization_config={"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
)

# The shape FishOmniConfig builds when config.json gives no fields: transformers' Qwen3.5-MoE text
# defaults (40 layers, every 4th full attention, 256 experts of 512 x 2048, vocabulary 248320) and
# the published audio-decoder defaults. Drama 3's own config.json is not public: this is the
# published class's shape, written out so that it is also read without vLLM-Omni.
DRAMA3_TEXT = dict(
    model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
    mlp_layer_types=["moe"] * 40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, vocab_size=248320,
)
DRAMA3_DECODER = dict(dim=2048, n_head=16, n_local_heads=2, head_dim=256, intermediate_size=6144,
                      num_codebooks=10, vocab_size=4096, shared_enrichment_layers=4, vq_backbone_codebooks=1)
DRAMA3_CFG = dict(FISH_CFG, text_config=DRAMA3_TEXT, audio_decoder_config=DRAMA3_DECODER,
                  semantic_start_token_id=248099, semantic_end_token_id=252194, audio_pad_token_id=248076,
                  eos_token_id=248046)

# The tiny fish_omni that vLLM-Omni's real engine runs on a CPU host (tests/e2e): the published
# token ids (eos 248046 is also pipeline.py's hard-coded stop token; the semantic band starts at
# 248099; a voice-clone prompt row is 248099 + a code of the DAC's 4096-entry semantic codebook, so
# the vocabulary reaches 252194), 10 codebooks (the DAC decoder's count) of 1024
# codes (inside both DAC codebooks: 4096 semantic, 1024 residual), linear-attention head dims 128
# in bfloat16 (vLLM's CPU gated-delta-rule kernel takes no other), bfloat16 experts (vLLM has no
# CPU MoE method for block FP8). Two KV heads of 128 keep vLLM's hybrid KV block at 128 tokens (the
# attention page must hold a GDN state page), so a request grows by whole blocks within a short run.
# Every head count splits over two tensor ranks (the TP2 runs): 2 query / 2 KV heads, 2 linear key
# and 2 linear value heads (vLLM's GDN layer divides both by the TP size), 4 experts for expert
# parallel, the tower's 2 query heads (its 1 KV head is replicated).
FISH_CPU_TEXT = dict(
    FISH_TEXT, hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=128, linear_num_key_heads=2,
    linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128, vocab_size=252224,
)
FISH_CPU_DECODER = dict(dim=128, n_head=2, n_local_heads=1, head_dim=64, intermediate_size=256, num_codebooks=10,
                        vocab_size=1024, shared_enrichment_layers=1, vq_backbone_codebooks=1)
FISH_CPU_CFG = {k: v for k, v in FISH_CFG.items() if k != "quantization_config"}
FISH_CPU_CFG.update(text_config=FISH_CPU_TEXT, audio_decoder_config=FISH_CPU_DECODER, semantic_start_token_id=248099,
                    semantic_end_token_id=248099 + 1023, audio_pad_token_id=248076, eos_token_id=248046)
# Special tokens of the prompt layout (fish_omni/prompt.py). The config fixes eos (<|im_end|>) and
# the audio pad; the others' ids are this stand-in's, in the gap below the semantic band.
FISH_SPECIAL_IDS = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<|voice|>": 248050,
                    "<|audio_pad|>": 248076, **{f"<|speaker:{i}|>": 248080 + i for i in range(4)}}


def fish_tensor_specs(cfg=FISH_CFG):
    """(name, dtype, shape, role) of every tensor of a fish_omni checkpoint.

    Roles: shard (split by TP), kv (k/v projections: by whole KV heads), rep (replicated),
    expert_w / expert_scale (routed experts), head (lm_head), tower, tower_eh (an eh_proj whose
    embedding half becomes a code table at load).
    """
    t, a = cfg["text_config"], cfg["audio_decoder_config"]
    H, V = t["hidden_size"], t["vocab_size"]
    nh, kv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv, K = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_conv_kernel_dim"]
    E, I, SI = t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
    # Without a quantization_config the routed experts are bfloat16 (no scales): what CPU runs need.
    fp8 = "quantization_config" in cfg
    b = cfg["quantization_config"]["weight_block_size"][0] if fp8 else None
    lm = "model.language_model."
    out = [(lm + "embed_tokens.weight", "BF16", (V, H), "shard"), (lm + "norm.weight", "BF16", (H,), "rep"),
           ("lm_head.weight", "BF16", (V, H), "head")]
    for i, kind in enumerate(t["layer_types"]):
        p = f"{lm}layers.{i}."
        out += [(p + "input_layernorm.weight", "BF16", (H,), "rep"),
                (p + "post_attention_layernorm.weight", "BF16", (H,), "rep")]
        if kind == "full_attention":
            s = p + "self_attn."
            out += [(s + "q_proj.weight", "BF16", (2 * nh * hd, H), "shard"), (s + "k_proj.weight", "BF16", (kv * hd, H), "kv"),
                    (s + "v_proj.weight", "BF16", (kv * hd, H), "kv"), (s + "o_proj.weight", "BF16", (H, nh * hd), "shard"),
                    (s + "q_norm.weight", "BF16", (hd,), "rep"), (s + "k_norm.weight", "BF16", (hd,), "rep")]
        else:
            s = p + "linear_attn."
            out += [(s + "in_proj_qkv.weight", "BF16", (2 * nk * dk + nv * dv, H), "shard"),
                    (s + "in_proj_z.weight", "BF16", (nv * dv, H), "shard"),
                    (s + "in_proj_b.weight", "BF16", (nv, H), "shard"), (s + "in_proj_a.weight", "BF16", (nv, H), "shard"),
                    (s + "conv1d.weight", "BF16", (2 * nk * dk + nv * dv, 1, K), "shard"),
                    (s + "A_log", "F32", (nv,), "rep"), (s + "dt_bias", "BF16", (nv,), "rep"),
                    (s + "norm.weight", "F32", (dv,), "rep"), (s + "out_proj.weight", "BF16", (H, nv * dv), "shard")]
        m = p + "mlp."
        out += [(m + "gate.weight", "BF16", (E, H), "rep"), (m + "shared_expert_gate.weight", "BF16", (1, H), "rep"),
                (m + "shared_expert.gate_proj.weight", "BF16", (SI, H), "shard"),
                (m + "shared_expert.up_proj.weight", "BF16", (SI, H), "shard"),
                (m + "shared_expert.down_proj.weight", "BF16", (H, SI), "shard")]
        for e in range(E):
            for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                x = f"{m}experts.{e}.{proj}."
                if not fp8:
                    out.append((x + "weight", "BF16", shape, "expert_w"))
                    continue
                out += [(x + "weight", "F8_E4M3", shape, "expert_w"),
                        (x + "weight_scale_inv", "F32", (-(-shape[0] // b), -(-shape[1] // b)), "expert_scale")]
    D, hq, hk, dh, FI = a["dim"], a["n_head"], a["n_local_heads"], a["head_dim"], a["intermediate_size"]
    C, CB, S = a["num_codebooks"], a["vocab_size"], a["shared_enrichment_layers"]
    out += [("audio_decoder.codebook_embeddings.weight", "BF16", (CB * C, H), "tower")]
    out += [(f"audio_decoder_mtp.heads.{k}.weight", "BF16", (CB, H), "tower") for k in range(C - 1)]
    layers = [f"audio_decoder_mtp_shared.layers.{i}." for i in range(S)]
    layers += [f"audio_decoder_mtp.layers.{j}." for j in range(C - 1)]
    for n, p in enumerate(layers):
        emb = "semantic_embedding" if n == 0 else "codebook_embedding"
        tl = p + "transformer_layer."
        out += [(p + f"{emb}.weight", "BF16", (CB, D), "tower"), (p + "enorm.weight", "BF16", (D,), "tower"),
                (p + "hnorm.weight", "BF16", (D,), "tower"),
                (p + "eh_proj.weight", "BF16", (D, 2 * D), "tower" if n == 0 else "tower_eh"),
                (tl + "attention.wqkv.weight", "BF16", (2 * hq * dh + 2 * hk * dh, D), "tower"),
                (tl + "attention.wo.weight", "BF16", (D, hq * dh), "tower"),
                (tl + "attention.q_norm.weight", "BF16", (dh,), "tower"),
                (tl + "attention.k_norm.weight", "BF16", (dh,), "tower"),
                (tl + "attention_norm.weight", "BF16", (D,), "tower"), (tl + "ffn_norm.weight", "BF16", (D,), "tower"),
                (tl + "feed_forward.w1.weight", "BF16", (FI, D), "tower"),
                (tl + "feed_forward.w3.weight", "BF16", (FI, D), "tower"),
                (tl + "feed_forward.w2.weight", "BF16", (D, FI), "tower"),
                (p + "final_layernorm.weight", "BF16", (D,), "tower")]
    return out


# A small DAC codec state dict (float32, as codec.pth stores it): name, shape, role.
# Roles: enc (stage 0's reference encoder only), shared (both stages), dec (stage 1 only),
# enc_g / dec_g (weight-norm magnitudes: stage 1 bakes them into the weights).
CODEC_SPECS = [
    ("encoder.block.0.conv.weight_g", (8, 1, 1), "enc_g"), ("encoder.block.0.conv.weight_v", (8, 1, 7), "enc"),
    ("encoder.block.0.conv.bias", (8,), "enc"),
    ("quantizer.pre_module.layers.0.attention.wqkv.weight", (24, 8), "enc"),
    ("quantizer.downsample.0.0.conv.weight", (8, 8, 2), "enc"),
    ("quantizer.semantic_quantizer.quantizers.0.codebook.weight", (64, 8), "shared"),
    ("quantizer.quantizer.quantizers.0.codebook.weight", (64, 8), "shared"),
    ("quantizer.upsample.0.0.conv.weight", (8, 8, 2), "shared"),
    ("quantizer.post_module.layers.0.attention.wqkv.weight", (24, 8), "shared"),
    ("decoder.model.0.conv.parametrizations.weight.original0", (16, 1, 1), "dec_g"),
    ("decoder.model.0.conv.parametrizations.weight.original1", (16, 8, 7), "dec"),
    ("decoder.model.0.conv.bias", (16,), "dec"), ("decoder.model.1.alpha", (1, 16, 1), "dec"),
]


def write_codec(path: Path, specs=CODEC_SPECS):
    """codec.pth as the published S2 Pro codec keeps it: a torch state dict under "generator"."""
    import torch

    torch.save({"generator": {n: torch.full(s, 0.5) for n, s, _ in specs}}, str(path))


def write_published_codec(path: Path, seed: int):
    """codec.pth for the published DAC (vLLM-Omni's ``build_dac_codec``, built on the meta device
    for its shapes only): seeded values for the ten vector quantizers (codebooks and their in/out
    projections: what maps codes to latents and back, 1.2 MB). Both stages load it with
    ``strict=False``, so the rest (2.8 GB of convolutions and transformers) keeps the module's own
    init, seeded by vLLM's worker seed; a tensor of any other shape would fail the load."""
    import torch
    from vllm_omni.model_executor.models.fish_speech.dac_utils import build_dac_codec

    with torch.device("meta"):
        codec = build_dac_codec()
    state = {}
    for name, tensor in codec.state_dict().items():
        if ".quantizers." in name:
            raw = seeded_values(name, "F32", tuple(tensor.shape), seed)
            state[name] = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(tensor.shape).clone()
    torch.save({"generator": state}, str(path))


def write_fish_tokenizer(d: Path, cfg=FISH_CPU_CFG, special=None):
    """tokenizer.json (made with the ``tokenizers`` package) and tokenizer_config.json: byte-level
    BPE over the 256 bytes (ids 0-255, no merges), the prompt's special tokens at their ids and
    the semantic band ``<|semantic:N|>`` from ``semantic_start_token_id`` (ids between are unused)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    special = dict(FISH_SPECIAL_IDS if special is None else special)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    first, last = cfg["semantic_start_token_id"], cfg["semantic_end_token_id"]
    semantic = {f"<|semantic:{i}|>": first + i for i in range(last - first + 1)}
    vocab.update(special)
    vocab.update(semantic)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special) + list(semantic))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 65536}))


def write_fish_checkpoint(d: Path, cfg=FISH_CFG, shards=1, sparse=False, codec=True, seed=None):
    """config.json in FishOmniConfig's format, safetensors (by hand, as above), codec.pth.

    With ``seed``: a checkpoint the real engine runs (seeded values, tokenizer files, codec.pth
    for the published DAC shapes), e.g. ``write_fish_checkpoint(d, FISH_CPU_CFG, seed=0)``.
    """
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    specs = [(n, t, s) for n, t, s, _ in fish_tensor_specs(cfg)]
    if seed is not None:
        write_fish_tokenizer(d, cfg)
        write_published_codec(d / "codec.pth", seed)
    elif codec:
        write_codec(d / "codec.pth")
    if shards == 1:
        write_safetensors(d / "model.safetensors", specs, sparse, seed)
        return
    per = -(-len(specs) // shards)
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = specs[k * per:(k + 1) * per]
        write_safetensors(d / fname, part, sparse, seed)
        weight_map.update({name: fname for name, _, _ in part})
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))



# The published depth at the tiny width: 40 layers, every 4th full attention, all MoE (the
# published Qwen3.5-MoE text defaults), 4 shared tower layers and 9 codebook layers.
FISH_CPU_DEEP_TEXT = dict(
    FISH_CPU_TEXT, num_hidden_layers=40, mlp_layer_types=["moe"] * 40,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
)
FISH_CPU_DEEP_CFG = dict(FISH_CPU_CFG, text_config=FISH_CPU_DEEP_TEXT,
                         audio_decoder_config=dict(FISH_CPU_DECODER, shared_enrichment_layers=4))
DEPTHS = {"tiny": FISH_CPU_CFG, "published": FISH_CPU_DEEP_CFG}
FP8_QUANT = {"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def tiny_config(depth: str = "tiny", fp8: bool = False) -> dict:
    """The config of a runnable tiny checkpoint: ``depth`` tiny or published, experts in bfloat16
    or (``fp8``) block FP8."""
    cfg = dict(DEPTHS[depth])
    if fp8:
        cfg["quantization_config"] = dict(FP8_QUANT)
    return cfg


def make(directory, depth: str = "tiny", fp8: bool = False, seed: int = 0) -> Path:
    """Write a runnable tiny checkpoint to ``directory`` (created; needs vLLM-Omni for the DAC's
    shapes). Returns the folder."""
    d = Path(directory)
    write_fish_checkpoint(d, tiny_config(depth, fp8), seed=seed)
    return d


def register(sub) -> None:
    p = sub.add_parser("tiny-model", help="write a tiny Drama 3 checkpoint in the published format (random "
                                          "weights) for rehearsals and start-up checks")
    p.add_argument("dir", help="the folder to write (new, or empty)")
    p.add_argument("--depth", choices=sorted(DEPTHS), default="tiny",
                   help="tiny: 4 backbone layers (default); published: 40 layers and 4+9 tower layers")
    p.add_argument("--fp8", action="store_true", help="routed experts in block FP8 with scales, as published "
                                                      "(the cards' expansion path; CPU hosts need bfloat16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    p.set_defaults(func=run)


def run(args) -> int:
    import importlib.util

    from drama3_patches.tools.files import InputError

    d = Path(args.dir)
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise InputError(f"{d} exists and is not an empty folder; give a new folder")
    if importlib.util.find_spec("vllm_omni") is None:
        raise InputError("needs vLLM-Omni 0.32.0rc1 installed (codec.pth takes the shapes of its DAC)")
    make(d, args.depth, args.fp8, args.seed)
    kind = "block-FP8" if args.fp8 else "bfloat16"
    print(f"wrote a tiny Drama 3 checkpoint ({args.depth} depth, {kind} experts, seed {args.seed}) to {d}",
          file=sys.stderr)
    return 0
