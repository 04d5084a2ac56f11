"""preemption-host-copy: a preempted Drama 3 request parks its frame history on the host.

The Drama 3 model state parks a preempted request's frame ``history`` and ``count`` in
``on_request_preempted(req_id, req_index)`` and restores them in ``add_request`` on resume,
possibly into another slot.  On CUDA the park is a pinned host copy plus an event; on any other
device it is a ``clone()``, which stays on the device, and the resume concatenates it with host
tensors: a device-mismatch error on NPU (and device memory held for every parked request).

The replacement runs the original method with ``clone()`` redirected for tensors that are
neither CUDA nor CPU: they become blocking host copies
(``.to("cpu", non_blocking=False, copy=True)``), complete before the method returns and so
before the scheduler can hand the slot to another request.  CPU tensors are still cloned
(independent snapshots) and the CUDA branch is not touched.  Redirecting the call rather than
rewriting the method keeps the model's own bookkeeping (its parking dict and resume path)
unchanged.
"""

from __future__ import annotations

import inspect

import torch
from torch.overrides import TorchFunctionMode

from drama3_patches.logger import init_logger
from drama3_patches.patchlib import NotNeeded, PatchContext, wrap

logger = init_logger(__name__)

_CLONES = {torch.Tensor.clone, torch.clone}


def needs_host_copy(t: object) -> bool:
    """A tensor on an accelerator that is not CUDA (NPU, XPU, ...): it must leave the device."""
    return isinstance(t, torch.Tensor) and not t.is_cuda and t.device.type not in ("cpu", "cuda", "meta")


class HostCopyClones(TorchFunctionMode):
    """Inside this mode, ``clone()`` of a non-CUDA accelerator tensor is a blocking host copy."""

    def __init__(self) -> None:
        super().__init__()
        self.host_copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CLONES and args and needs_host_copy(args[0]):
            memory_format = kwargs.get("memory_format", torch.preserve_format)
            self.host_copies += 1
            return args[0].to("cpu", non_blocking=False, copy=True, memory_format=memory_format)
        return func(*args, **kwargs)


def _parks_with_clone(method) -> bool | None:
    """Does the method take a ``clone()`` (the port's non-CUDA branch)?  None: source unreadable."""
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        return None
    return ".clone(" in source or "torch.clone(" in source


def build(original):
    @wrap(original)
    def on_request_preempted(self, *args, **kwargs):
        with HostCopyClones():
            return original(self, *args, **kwargs)

    return on_request_preempted


def plan(ctx: PatchContext) -> dict:
    replacements = {}
    for target in ctx.targets:
        original = ctx.original(target)
        if not callable(original):
            ctx.leave(target, f"{target} is {type(original).__name__}, not a method")
            continue
        if _parks_with_clone(original) is False:
            # Feature detection: without a clone() there is nothing left on the device.
            raise NotNeeded(f"{target} takes no clone(): it already parks state without a device copy")
        replacements[target] = build(original)
    return replacements
