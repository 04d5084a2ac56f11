"""The eager kernels traced whole by Dynamo (``fullgraph=True``), as vLLM compiles stage 0's
forward: no graph break, and the traced results equal the eager ones bit for bit, at the
published tower shapes (``support.tower_calls``). The engine-level check is
tests/e2e/test_compiled.py; this one runs in seconds, without vLLM.
"""

from __future__ import annotations

import pytest

from support.tiers import TORCH_ABSENT

torch = pytest.importorskip("torch", reason=TORCH_ABSENT)

from support.tower_calls import tower_calls  # noqa: E402


def _flat(out):
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", sorted(tower_calls(1)))
def test_kernel_traces_as_one_graph_with_the_eager_results(name):
    torch._dynamo.reset()
    kernel, args, kwargs = tower_calls(2, seed=3)[name]
    eager = _flat(kernel(*args, **kwargs))
    kernel, args, kwargs = tower_calls(2, seed=3)[name]  # fresh inputs: some kernels write in place
    traced = _flat(torch.compile(kernel, fullgraph=True, backend="eager")(*args, **kwargs))
    assert len(traced) == len(eager) > 0
    for t, e in zip(traced, eager):
        assert t.dtype == e.dtype and torch.equal(t, e), name
