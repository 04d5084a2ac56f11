"""fish-omni-tower-tp-split: each tensor-parallel rank holds its share of the codebook tower's heads.

Record: ``patches_manifest.yaml``, id ``fish-omni-tower-tp-split`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: ``build`` wraps ``TowerLayer.__init__``: with more than one tensor rank the original
runs on :func:`local_config` (the decoder config with this rank's head counts), then
:func:`split_layer` gives ``qkv_proj`` and ``o_proj`` loaders that cut the checkpoint's full
tensors per rank and turns ``o_proj`` into :class:`RowParallelOut`. ``builds_all_heads`` is the
feature detection: a copy of the constructor, its ``Attention`` replaced by a recorder, run on
a tiny config. The per-rank slicing is in ``drama3_patches.kernels.tensor_parallel``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
from types import SimpleNamespace

import torch

from drama3_patches.kernels.tensor_parallel import HeadSplit, head_split, output_columns, qkv_gate_rows
from drama3_patches.logger import init_logger, warning_once
from drama3_patches.patchlib import PatchContext, function_wrapper, replace_where_needed

logger = init_logger(__name__)

SPLIT_ATTR = "tp_split"  # the HeadSplit of a split layer (absent on a whole one)


class RowParallelOut(torch.nn.Linear):
    """The tower's output projection on a rank's heads: a partial product, summed over the group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from vllm.distributed import tensor_model_parallel_all_reduce

        # The bias is whole on every rank: added once, after the sum, not once per rank.
        out = tensor_model_parallel_all_reduce(torch.nn.functional.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def tp_rank_size() -> tuple[int, int]:
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def local_config(config, split: HeadSplit):
    """A shallow copy of the decoder config with the rank's head counts (head size unchanged)."""
    local = copy.copy(config)
    local.n_head, local.n_local_heads = split.num_heads, split.num_kv_heads
    return local


def _load_qkv(split: HeadSplit, heads: int, kv_heads: int, head_dim: int, param, loaded):
    param.data.copy_(qkv_gate_rows(loaded, heads, kv_heads, head_dim, split))


def _load_out(split: HeadSplit, head_dim: int, param, loaded):
    param.data.copy_(output_columns(loaded, head_dim, split))


def split_layer(layer, config, split: HeadSplit) -> None:
    """Loaders that take the checkpoint's whole tensors, and the all-reduced output projection."""
    heads, kv_heads, head_dim = config.n_head, config.n_local_heads, config.head_dim
    layer.qkv_proj.weight.weight_loader = functools.partial(_load_qkv, split, heads, kv_heads, head_dim)
    layer.o_proj.weight.weight_loader = functools.partial(_load_out, split, head_dim)
    layer.o_proj.__class__ = RowParallelOut
    setattr(layer, SPLIT_ATTR, split)


def build(original):
    signature = inspect.signature(original)

    def tower_layer_init(wrapped, instance, args, kwargs):
        rank, size = tp_rank_size()
        if size == 1:
            return wrapped(*args, **kwargs)
        bound = signature.bind(instance, *args, **kwargs)
        config = bound.arguments["config"]
        try:
            split = head_split(config.n_head, config.n_local_heads, size, rank)
        except ValueError as exc:
            # every layer of the tower has the same heads: one line, not one per layer
            warning_once(logger, str(exc), "fish-omni-tower-tp-split: %s; the tower's layers keep every head on "
                         "every rank", exc)
            return wrapped(*args, **kwargs)
        bound.arguments["config"] = local_config(config, split)
        result = wrapped(*bound.args[1:], **bound.kwargs)
        split_layer(instance, config, split)
        return result

    return function_wrapper(original, tower_layer_init)


# ----------------------------------------------------------------------------------------------
# Feature detection
# ----------------------------------------------------------------------------------------------


class _RecordedAttention(torch.nn.Module):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, **kwargs):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads


def builds_all_heads(original) -> bool:
    """True when the constructor gives every rank all heads in plain ``nn.Linear`` projections.

    Runs a copy of it (same code; its ``Attention`` a recorder, its activation an identity) on a
    4-head config on the meta
    device; a constructor that splits by itself (fewer heads, or vLLM's parallel linear
    layers) is not the one this patch fixes.
    """
    func = inspect.unwrap(original)
    # Attention and vLLM's CustomOps need a current vLLM config; the probe has none.
    namespace = dict(func.__globals__, Attention=_RecordedAttention, SiluAndMul=torch.nn.Identity)
    probe_init = types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, func.__closure__)
    config = SimpleNamespace(dim=8, n_head=4, n_local_heads=2, head_dim=2, norm_eps=1e-6, vocab_size=4,
                             intermediate_size=8)
    owner = func.__globals__["TowerLayer"]
    layer = object.__new__(owner)
    with torch.device("meta"):
        probe_init(layer, config, SimpleNamespace(rotary_dim=2), None, "probe")
    plain = type(layer.qkv_proj) is torch.nn.Linear and type(layer.o_proj) is torch.nn.Linear
    # Rows [query | gate | key | value] for all heads: no rank's share taken.
    rows = 2 * (config.n_head + config.n_local_heads) * config.head_dim
    return plain and layer.attn.num_heads == config.n_head and layer.qkv_proj.weight.shape[0] == rows


def plan(ctx: PatchContext) -> dict:
    return replace_where_needed(ctx, builds_all_heads, build, kind="method",
                                checking="how it builds its attention heads",
                                fixed="already builds the tower's attention per tensor-parallel rank")
