"""Drama 3's KV cache groups and full-length sequences per card: TP1, TP2 published, TP2 with the tower split.

vLLM's own ``get_kv_cache_configs`` (``vllm/v1/core/kv_cache_utils.py`` in 0.31/0.32;
``vllm/v1/core/kv_cache_planning.py`` from 0.33 on, :1461 in 0.33 and :1565 in 0.34, with the
model's groups from ``get_global_kv_cache_groups`` as a new required argument) groups the layers' KV
specs and sizes the block pool for one card's memory; ``get_max_concurrency_for_kv_cache_config``
turns that into how many ``max_model_len``-token sequences fit. The specs are the ones Drama 3's
stage-0 layers build at the given tensor-parallel size, from the same vLLM pieces they call:

* backbone full attention (every 4th layer): ``FullAttentionSpec`` with the Qwen3-Next layer's
  per-rank key/value heads (``max(1, kv // tp)``), head size, bfloat16;
* backbone gated delta net: ``MambaSpec`` from ``MambaStateShapeCalculator.gated_delta_net_state_shape``
  and ``MambaStateDtypeCalculator.gated_delta_net_state_dtype`` (``mamba_ssm_cache_dtype`` as the
  profile sets it), its page padded to the attention page as ``Platform._align_hybrid_block_size``
  does (the attention block grows in steps of the kernel block until its page holds the state);
* codebook tower (13 layers): ``FullAttentionSpec`` with every key/value head (published, at any
  TP) or the rank's heads from ``drama3_patches.kernels.tensor_parallel.head_split``, the split
  the fish-omni-tower-tp-split patch builds the layer with.

Shapes: ``drama3_patches/tools/tiny_model.py`` ``DRAMA3_CFG`` (the published FishOmniConfig's class
shape); settings: the 910b-tp2-ep profile (128-token blocks, max_model_len 8192, float32 GDN
state). Memory for KV per card: ``--memory-gib`` (default 15.15, what ``drama3-patches plan
--deploy 910b-tp2-ep`` leaves on a 910B1), the same for every row so that the rows compare
the layouts alone. Run::

    python benchmarks/tower_kv_groups.py
    python benchmarks/tower_kv_groups.py --memory-gib 20 --max-model-len 4096
"""

from __future__ import annotations

import argparse
import math
import sys
from types import SimpleNamespace

GIB = 1 << 30


def drama3_shapes() -> dict:
    from drama3_patches.tools.tiny_model import DRAMA3_CFG

    return DRAMA3_CFG


def layer_specs(cfg: dict, tp: int, tower_split: bool, *, block_size: int, ssm_dtype: str,
                kernel_block: int = 128) -> tuple[dict, int]:
    """``{layer name: spec}`` of one rank (rank 0; every rank's are alike) and the block size."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from drama3_patches.kernels.tensor_parallel import head_split

    text, decoder = cfg["text_config"], cfg["audio_decoder_config"]
    kv = text["num_key_value_heads"]
    backbone_kv = max(1, kv // tp)
    head = text["head_dim"]
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, text["linear_num_key_heads"], text["linear_num_value_heads"], text["linear_key_head_dim"],
        text["linear_value_head_dim"], text["linear_conv_kernel_dim"], 0)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", ssm_dtype)
    state_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    # Platform._align_hybrid_block_size: attention page (backbone heads) >= state page.
    per_token = FullAttentionSpec(block_size=1, num_kv_heads=backbone_kv, head_size=head,
                                  dtype=torch.bfloat16).page_size_bytes
    align = max(kernel_block, block_size)
    block = max(block_size, align * math.ceil(state_page / (align * per_token)))
    padded = block * per_token

    if tower_split:
        tower_kv = head_split(decoder["n_head"], decoder["n_local_heads"], tp, 0).num_kv_heads
    else:
        tower_kv = decoder["n_local_heads"]
    specs = {}
    for i, kind in enumerate(text["layer_types"]):
        name = f"model.layers.{i}"
        if kind == "full_attention":
            specs[f"{name}.self_attn.attn"] = FullAttentionSpec(
                block_size=block, num_kv_heads=backbone_kv, head_size=head, dtype=torch.bfloat16)
        else:
            specs[f"{name}.linear_attn"] = MambaSpec(
                shapes=shapes, dtypes=dtypes, block_size=block, page_size_padded=padded)
    layers = decoder["shared_enrichment_layers"] + decoder["num_codebooks"] - 1
    for i in range(layers):
        specs[f"audio_decoder.layers.{i}.attn"] = FullAttentionSpec(
            block_size=block, num_kv_heads=tower_kv, head_size=decoder["head_dim"], dtype=torch.bfloat16)
    return specs, block


def vllm_config_for(max_model_len: int, block_size: int, tp: int, layout: str = "NHD"):
    """A VllmConfig carrying what the KV sizing reads (the model config's lengths only)."""
    from vllm.config import CacheConfig, DeviceConfig, ParallelConfig, VllmConfig

    config = VllmConfig(cache_config=CacheConfig(block_size=block_size), device_config=DeviceConfig(device="cpu"),
                        parallel_config=ParallelConfig(tensor_parallel_size=tp))
    # get_kv_cache_configs reads max_model_len (and whether it was asked to fit it) from the model
    # config; building a real one needs the model's architecture registered, not what is measured.
    object.__setattr__(config, "model_config", SimpleNamespace(
        max_model_len=max_model_len, original_max_model_len=max_model_len, use_mla=False))
    # A hybrid (GDN + attention) model runs vLLM's hybrid KV cache manager; a bare config has it off.
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    # The engine core resolves the layout from the backends; vLLM's default (NHD) unless told.
    config.cache_config.kv_cache_layout = layout
    return config


def kv_cache_configs(vllm_config, specs: list, memory: list) -> list:
    """vLLM's get_kv_cache_configs wherever this vLLM keeps it (found by feature, not by version)."""
    try:  # vLLM 0.33 on: the planning module, with the model's groups computed first
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    except ImportError:  # vLLM 0.31/0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        return get_kv_cache_configs(vllm_config, specs, memory)
    return get_kv_cache_configs(vllm_config, specs, memory, get_global_kv_cache_groups(vllm_config, specs))


def measure(cfg: dict, tp: int, tower_split: bool, *, memory: int, block_size: int, max_model_len: int,
            ssm_dtype: str, layout: str = "NHD") -> dict:
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    specs, block = layer_specs(cfg, tp, tower_split, block_size=block_size, ssm_dtype=ssm_dtype)
    vllm_config = vllm_config_for(max_model_len, block, tp, layout)
    (kv_config,) = kv_cache_configs(vllm_config, [specs], [memory])
    pages = sorted({g.kv_cache_spec.page_size_bytes for g in kv_config.kv_cache_groups})
    state = next(s for s in specs.values() if type(s).__name__ == "MambaSpec")
    return {"groups": len(kv_config.kv_cache_groups), "block_size": block, "num_blocks": kv_config.num_blocks,
            "pages": pages, "state_page": state.real_page_size_bytes,
            "sequences": get_max_concurrency_for_kv_cache_config(vllm_config, kv_config)}


ROWS = (("TP1", 1, False), ("TP2 published", 2, False), ("TP2 tower split", 2, True))


def table(memory_gib: float = 15.15, max_model_len: int = 8192, block_size: int = 128,
          ssm_dtype: str = "float32", layout: str = "NHD") -> list[tuple[str, dict]]:
    cfg = drama3_shapes()
    memory = int(memory_gib * GIB)
    return [(label, measure(cfg, tp, split, memory=memory, block_size=block_size, max_model_len=max_model_len,
                            ssm_dtype=ssm_dtype, layout=layout)) for label, tp, split in ROWS]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-gib", type=float, default=15.15, help="KV memory per card (GiB)")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--mamba-ssm-cache-dtype", default="float32")
    parser.add_argument("--layout", default="NHD", help="KV cache layout the backends resolve (vLLM's names)")
    args = parser.parse_args(argv)
    rows = table(args.memory_gib, args.max_model_len, args.block_size, args.mamba_ssm_cache_dtype, args.layout)
    print(f"Drama 3 stage 0, {args.memory_gib} GiB of KV per card, {args.max_model_len}-token sequences, "
          f"{args.mamba_ssm_cache_dtype} GDN state, {args.layout} layout (vLLM get_kv_cache_configs)")
    print(f"{'layout':<17}{'KV groups':>10}{'block':>7}{'pages (B)':>24}{'GDN state (B)':>15}"
          f"{'blocks':>8}{'sequences':>11}{'vs TP2 pub':>11}")
    base = rows[1][1]["sequences"]
    for label, r in rows:
        pages = "/".join(f"{p:,}" for p in r["pages"])
        print(f"{label:<17}{r['groups']:>10}{r['block_size']:>7}{pages:>24}{r['state_page']:>15,}"
              f"{r['num_blocks']:>8}{r['sequences']:>11.1f}{r['sequences'] / base:>10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
