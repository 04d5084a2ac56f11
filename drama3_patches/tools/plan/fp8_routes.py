"""The two load routes of block-FP8 routed experts on a card without MXFP8, per card.

* native: vLLM-Ascend's own block-FP8 MoE method (0.30.0rc2: ``AscendFp8BlockFusedMoEMethod``,
  ``quantization/methods/w8a8/fp8_block.py``), which patch fp8-expert-method takes where it exists.
  vLLM loads every layer's FP8 experts onto the card; then, layer by layer,
  ``process_weights_after_loading`` builds a resolved model-dtype copy of w13 beside its FP8 source
  (one expert at a time, with float32 temporaries of one band of rows), swaps it in, does the same
  for w2, and the bf16 method (``AscendUnquantizedFusedMoEMethod``) replaces each by a transposed
  contiguous copy. So a layer's FP8 weights and their resolved copy are on the card at once.
* cpu: the patch's expansion. The checkpoint's FP8 lands in host buffers; each weight's bf16 output
  is allocated on the card in its final layout and filled one expert at a time from the host. The
  card never holds more than the final resident set; the host holds the card's FP8 experts.

Both routes end with the same bf16 experts on the card. The native route is named where its peak
fits the stage's budget; otherwise the deploy must keep the CPU expansion
(``DRAMA3_PATCHES_FP8_ROUTE=cpu``).
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM-Ascend 0.30.0rc2 resolves at most this many rows of one expert per step (fp8_block.py).
ROWS_PER_STEP = 1024
ROUTE_ENV = "DRAMA3_PATCHES_FP8_ROUTE"


@dataclass
class ExpertLayer:
    """One MoE layer's routed experts as stored (FP8 + scales) and resolved (bf16), whole model."""

    index: int
    w13_stored: float = 0
    w2_stored: float = 0
    w13_bf16: float = 0
    w2_bf16: float = 0


def _staging(hidden: int, inter: int, per_expert_w13: float, per_expert_w2: float) -> tuple[float, float]:
    """Transient bytes while one expert is resolved: its bf16 result, plus the float32 band of rows
    (weight, scales and product) of one step."""
    w13 = per_expert_w13 + 3 * 4 * min(ROWS_PER_STEP, 2 * inter) * hidden
    w2 = per_expert_w2 + 3 * 4 * min(ROWS_PER_STEP, hidden) * inter
    return w13, w2


def route_peaks(layers: list[ExpertLayer], shape, efrac: float, fixed: float) -> dict:
    """Per card: the load peak of each route (bytes), where the native one peaks, the host bytes of
    the CPU route. ``layers``: the checkpoint's experts per layer (``plan.model.expert_layers``);
    ``efrac``: the share of each layer's experts a card holds; ``fixed``: everything else resident
    on the card before the experts are post-processed (dense weights, tower, buffers)."""
    if not layers:
        return {}
    stored = [(lay.w13_stored + lay.w2_stored) * efrac for lay in layers]
    bf16 = [(lay.w13_bf16 + lay.w2_bf16) * efrac for lay in layers]
    experts = max(1, shape.num_experts)
    native, where = 0.0, ""
    for k, lay in enumerate(layers):
        done, rest = sum(bf16[:k]), sum(stored[k + 1:])
        w13, w2 = lay.w13_bf16 * efrac, lay.w2_bf16 * efrac
        stage13, stage2 = _staging(shape.hidden_size, shape.moe_intermediate, lay.w13_bf16 / experts,
                                   lay.w2_bf16 / experts)
        steps = {
            "w13 resolved beside its FP8 source": stored[k] + w13 + stage13,
            "w2 resolved beside its FP8 source": lay.w2_stored * efrac + w13 + w2 + stage2,
            "w13 transposed copy": w13 + w2 + w13,
            "w2 transposed copy": w13 + w2 + w2,
        }
        step, peak = max(steps.items(), key=lambda kv: kv[1])
        if fixed + done + rest + peak > native:
            native, where = fixed + done + rest + peak, f"layer {lay.index}: {step}"
    return {
        "native": native,
        "native_at": where,
        "cpu": fixed + sum(bf16),
        "cpu_host": sum(stored),
    }


def choose(peaks: dict, budget: float) -> tuple[str, str]:
    """The route the deploy takes, and why: native where vLLM-Ascend has the method and its peak fits."""
    gib = 1024 ** 3
    if peaks["native"] <= budget:
        return "native", (f"its load peak {peaks['native'] / gib:.2f} GiB fits the stage's {budget / gib:.2f} GiB "
                          "(where the installed vLLM-Ascend has a block-FP8 MoE method, 0.30.0rc2 on; "
                          "else the CPU expansion)")
    return "cpu", (f"the native load peak {peaks['native'] / gib:.2f} GiB exceeds the stage's {budget / gib:.2f} "
                   f"GiB: keep the CPU expansion with {ROUTE_ENV}=cpu")
