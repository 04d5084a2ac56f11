"""Count what eager torch code dispatches: a ``TorchDispatchMode`` over aten ops.

Deterministic (it counts ops, never times them), so launch counts can be test budgets.
Each aten op that reaches the mode falls in one class:

* ``views``: aliasing ops (view, slice, select, unsqueeze, ...; ``to`` / ``reshape`` /
  ``contiguous`` when they return their input's storage) and pure metadata ops: no device work;
* ``allocs``: ``empty*`` / ``new_empty*``: memory, no kernel;
* ``syncs``: ops that read a device value on the host (``_local_scalar_dense`` behind
  ``.item()`` / ``bool()``, ``nonzero``, ``equal``, boolean-mask indexing, ...);
* ``launches``: everything else, one device kernel each (an upper bound for an op that
  some backend fuses, which is the point of a budget).

Composite ops (``CompositeImplicitAutograd``: ``to``, ``reshape``, ``rms_norm``, ...), which
inference mode hands to the mode whole, are counted as the ops they decompose into.

``count(fn, *args)`` returns a :class:`Counts`; ``Counts.by_op`` names every launch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Counts", "LaunchCounter", "count"]

_ALLOCS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
# Metadata only, though the schema does not mark them as views.
_METADATA = {"_unsafe_view", "lift_fresh", "_reshape_alias", "sym_size", "sym_stride", "sym_numel",
             "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"}
_SYNCS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select", "_unique", "_unique2",
          "unique_dim", "unique_consecutive", "allclose", "item"}


@dataclass
class Counts:
    launches: int = 0
    views: int = 0
    allocs: int = 0
    syncs: int = 0
    by_op: Counter = field(default_factory=Counter)
    sync_ops: list = field(default_factory=list)

    @property
    def ops(self) -> int:
        return self.launches + self.views + self.allocs + self.syncs


def _bool_index(args) -> bool:
    # x[mask] and x[mask] = v: aten.index / index_put_ with a boolean index run nonzero inside.
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _may_alias(func) -> bool:
    # A return annotated Tensor(a) without a write: a view, or (``to``, ``reshape``, ``contiguous``
    # as inference mode dispatches them) the input itself or a copy, told apart by the result.
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _shares_input(args, result) -> bool:
    if not isinstance(result, torch.Tensor):
        return True
    ptr = result.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in args)


def classify(func, args, result) -> str:
    name = func.overloadpacket.__name__
    if name in _SYNCS:
        return "syncs"
    if name in ("index", "index_put", "index_put_") and _bool_index(args):
        return "syncs"
    if name in _ALLOCS:
        return "allocs"
    if name in _METADATA:
        return "views"
    if func.is_view or _may_alias(func):
        return "views" if _shares_input(args, result) else "launches"
    return "launches"


class LaunchCounter(TorchDispatchMode):
    """Inside ``with LaunchCounter() as c:``, ``c.counts`` accumulates every aten op by class."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = Counts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # Inference mode hands composite ops (to, reshape, rms_norm, ...) to the mode whole;
            # their decomposition is what runs: count its ops instead.
            with self:
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        result = func(*args, **kwargs)
        self.record(func, classify(func, args, result))
        return result

    def record(self, func, kind: str) -> None:
        """Add one op of class ``kind`` (a subclass may attribute it further)."""
        c = self.counts
        setattr(c, kind, getattr(c, kind) + 1)
        if kind == "launches":
            c.by_op[func.overloadpacket.__name__] += 1
        elif kind == "syncs":
            c.sync_ops.append(str(func))


def count(fn, *args, **kwargs) -> Counts:
    """Run ``fn(*args, **kwargs)`` once under a :class:`LaunchCounter` (no autograd) and return its counts."""
    with torch.inference_mode(), LaunchCounter() as counter:
        fn(*args, **kwargs)
    return counter.counts
