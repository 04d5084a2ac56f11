"""preemption-host-copy: a preempted Drama 3 request parks its generated codes on the host.

Record: ``patches_manifest.yaml``, id ``preemption-host-copy`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: ``build`` (a wrapt ``FunctionWrapper``) runs the original, then ``park_on_host``
replaces the parked ``PARKED`` tensors that ``needs_host_copy``. Feature detection
(``parks_off_host``) runs the method's own body, copied by ``_own_body`` with its ``super()``
pointed at ``_QuietParent``, on ``meta`` buffers.
"""

from __future__ import annotations

import inspect
import types
from types import SimpleNamespace

import torch

from drama3_patches.logger import init_logger
from drama3_patches.patchlib import PatchContext, function_wrapper, replace_where_needed

logger = init_logger(__name__)

PARKED = ("history", "count")


def needs_host_copy(t: object) -> bool:
    """A tensor on an accelerator that is not CUDA (NPU, XPU, ...): it must leave the device."""
    return isinstance(t, torch.Tensor) and not t.is_cuda and t.device.type not in ("cpu", "cuda", "meta")


def park_on_host(state, req_id) -> int:
    """Move ``state._suspended[req_id]``'s history and count to the host; returns how many moved."""
    parked = getattr(state, "_suspended", {}).get(req_id)
    if parked is None or getattr(parked, "event", None) is not None:
        return 0  # nothing parked (the request had no slot), or the CUDA branch's pinned copy
    moved = 0
    for name in PARKED:
        tensor = getattr(parked, name)
        if needs_host_copy(tensor):
            # Blocking: the copy has landed before the scheduler can reuse the slot.
            setattr(parked, name, tensor.to("cpu", non_blocking=False, copy=True))
            moved += 1
    return moved


def build(original):
    signature = inspect.signature(original)
    # The request id is the parking key: the published parameter name, else the first after self.
    key = "req_id" if "req_id" in signature.parameters else list(signature.parameters)[1]

    def on_request_preempted(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        park_on_host(instance, signature.bind(instance, *args, **kwargs).arguments[key])
        return result

    # Same signature as the published method: a FunctionWrapper, bound as the method was.
    return function_wrapper(original, on_request_preempted)


# ----------------------------------------------------------------------------------------------
# Feature detection
# ----------------------------------------------------------------------------------------------


class _QuietParent:
    def on_request_preempted(self, *args, **kwargs):
        return None


class _Probe(_QuietParent):
    """Stands in for the model state while the method's own body runs."""


def _own_body(method):
    """``method`` with its zero-argument ``super()`` resolving to :class:`_QuietParent`.

    The parents' suspend logic is not what this patch is about (and needs a live runner); the
    body's ``__class__`` cell is the only thing changed, the code object is the published one.
    """
    code = getattr(method, "__code__", None)
    if code is None:
        raise TypeError(f"{method!r} has no code object to probe")
    cells = list(method.__closure__ or ())
    if "__class__" in code.co_freevars:
        cells[code.co_freevars.index("__class__")] = types.CellType(_Probe)
    return types.FunctionType(code, method.__globals__, method.__name__, method.__defaults__, tuple(cells) or None)


def parks_off_host(method) -> bool:
    """Run the method body on ``meta`` slot buffers: True when its non-CUDA park stays on the device.

    False when it copies the parked codes to the host.  Raises ``LookupError`` when the body
    parks nothing under ``_suspended[req_id]`` with a history and a count (drift).
    """
    probe = _Probe()
    probe.buffers = SimpleNamespace(
        slot_history=torch.zeros((3, 4, 2), dtype=torch.int16, device="meta"),
        slot_generated=torch.zeros(3, dtype=torch.int64, device="meta"),
    )
    probe._suspended = {}
    try:
        _own_body(method)(probe, "probe", 1)
    except NotImplementedError as exc:
        if "meta" in str(exc):  # it tried to bring the data to the host
            return False
        raise
    parked = probe._suspended.get("probe")
    if parked is None or not all(isinstance(getattr(parked, n, None), torch.Tensor) for n in PARKED):
        raise LookupError(f"parks no history/count under _suspended[req_id] (got {parked!r})")
    return any(getattr(parked, n).device.type == "meta" for n in PARKED)


def plan(ctx: PatchContext) -> dict:
    return replace_where_needed(ctx, parks_off_host, build, kind="method",
                                checking="where a preempted request is parked",
                                fixed="already copies the parked history and count to the host off CUDA")
