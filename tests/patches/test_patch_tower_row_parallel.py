"""fish-omni-tower-tp-split without a process group: the output projection sums the partial products
and adds the bias once (the all-reduce stood in by a two-rank sum); a head count that does not
split is logged once per process."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_row_parallel_out_adds_the_bias_once_after_the_reduce(monkeypatch):
    import torch
    import vllm.distributed

    from drama3_patches.patches.fish_omni_tower_tp_split import RowParallelOut

    # Two ranks holding the same partial product: the all-reduce doubles it.
    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_reduce", lambda t: t * 2)
    layer = torch.nn.Linear(3, 2, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]))
        layer.bias.copy_(torch.tensor([10.0, 20.0]))
    layer.__class__ = RowParallelOut
    got = layer(torch.tensor([[1.0, 2.0, 3.0]]))
    assert got.tolist() == [[2.0 + 10.0, 10.0 + 20.0]]  # 2 × x·W + b, not 2 × (x·W + b)


def test_unsplittable_heads_warn_once_per_process_not_per_layer(monkeypatch):
    """Four layers whose 4 heads do not split over 3 ranks: built whole, one warning line."""
    import logging
    from types import SimpleNamespace

    from drama3_patches import logger as logger_mod
    from drama3_patches.patches import fish_omni_tower_tp_split as split

    monkeypatch.setattr(split, "tp_rank_size", lambda: (0, 3))
    monkeypatch.setattr(logger_mod, "_warned", set())
    built = []

    class Layer:
        def __init__(self, config):
            built.append(config.n_head)

    Layer.__init__ = split.build(Layer.__dict__["__init__"])
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    split.logger.addHandler(handler)
    try:
        for _ in range(4):
            Layer(SimpleNamespace(n_head=4, n_local_heads=2))
    finally:
        split.logger.removeHandler(handler)
    assert built == [4, 4, 4, 4]  # every layer kept its heads
    assert [r.getMessage() for r in records] == [
        "fish-omni-tower-tp-split: 4 query heads do not split over 3 ranks; "
        "the tower's layers keep every head on every rank"]
