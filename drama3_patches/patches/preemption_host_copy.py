"""preemption-host-copy: a preempted Drama 3 request parks its generated codes on the host.

Record: ``patches_manifest.yaml``, id ``preemption-host-copy`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: ``build`` (a wrapt ``FunctionWrapper``) runs the original, then ``park_on_host``
replaces the parked ``PARKED`` tensors that ``needs_host_copy``. Feature detection
(``parks_off_host``) runs the method's own body, copied by ``_own_body`` with its ``super()``
pointed at ``_QuietParent``, on ``meta`` buffers.

The resume check (``DRAMA3_PATCHES_RESUME_CHECK=1``): at preemption ``HistoryLedger.keep``
takes a host copy of the frames parked (a few KB: a copy rather than a digest, so a resume that
brings back fewer frames is checked on its prefix); ``build_resume`` wraps ``add_request`` and
compares what the published code queued for the slot (``_pending_history``) with that copy,
raising :class:`ResumedHistoryMismatch` on a difference. Each process's report counts
``preemptions``, ``resumes`` and ``resumes_verified``.
"""

from __future__ import annotations

import inspect
import threading
import types
from types import SimpleNamespace

import torch

from drama3_patches import env
from drama3_patches.engine import state
from drama3_patches.logger import init_logger
from drama3_patches.patchlib import PatchContext, function_wrapper, replace_where_needed

logger = init_logger(__name__)

PARKED = ("history", "count")
MODEL_STATE = "vllm_omni.model_executor.models.fish_omni.model_state:FishOmniModelState"
PREEMPT = f"{MODEL_STATE}.on_request_preempted"
RESUME = f"{MODEL_STATE}.add_request"


class ResumedHistoryMismatch(RuntimeError):
    """A resumed request was fed back frames other than those it had when preempted."""


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


class HistoryLedger:
    """Host copies of the frames each preempted request parked, by request id, per model state."""

    ATTR = "_drama3_parked_frames"

    @classmethod
    def of(cls, model_state) -> dict:
        ledger = model_state.__dict__.get(cls.ATTR)
        if ledger is None:
            ledger = model_state.__dict__.setdefault(cls.ATTR, {})
        return ledger

    @classmethod
    def keep(cls, model_state, req_id) -> None:
        """Copy the parked frames before the slot can be reused (the park is on the host by now,
        or a host clone on CPU runs): the count read is no device sync there."""
        parked = getattr(model_state, "_suspended", {}).get(req_id)
        if parked is None or getattr(parked, "event", None) is not None:
            return
        frames = int(parked.count.reshape(-1)[0])
        cls.of(model_state)[req_id] = parked.history[:frames].to("cpu", copy=True)
        if frames and env.fault("parked-history"):
            # Test-only: the slot's reuse scribbled over the parked frames.
            parked.history[frames - 1, 0] += 1

    @classmethod
    def verify(cls, model_state, req_id, kept, fed) -> None:
        """``fed``: the ``[frames, codebooks]`` history the resumed slot is given."""
        frames = fed.shape[0]
        expected = kept[:frames].to(fed.dtype)
        if frames > kept.shape[0] or not torch.equal(fed.to("cpu"), expected):
            same = expected.shape[0] if frames > kept.shape[0] else frames
            bad = next((i for i in range(same) if not torch.equal(fed[i].to("cpu"), expected[i])), same)
            raise ResumedHistoryMismatch(
                f"request {req_id}: resumed with {frames} frames of history, {kept.shape[0]} parked at "
                f"preemption; they differ from frame {bad} on ({env.RESUME_CHECK}=1). The request would "
                "continue from frames it never generated: stop the deployment and report it with this line")
        state.count("resumes_verified")


def build(original):
    signature = inspect.signature(original)
    # The request id is the parking key: the published parameter name, else the first after self.
    key = "req_id" if "req_id" in signature.parameters else list(signature.parameters)[1]

    def on_request_preempted(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        req_id = signature.bind(instance, *args, **kwargs).arguments[key]
        park_on_host(instance, req_id)
        state.count("preemptions")
        if env.resume_check():
            HistoryLedger.keep(instance, req_id)
        return result

    # Same signature as the published method: a FunctionWrapper, bound as the method was.
    return function_wrapper(original, on_request_preempted)


_no_pending = threading.Event()  # set once the "cannot verify" warning was given


def build_resume(original):
    signature = inspect.signature(original)
    index_key, data_key = list(signature.parameters)[1:3]

    def add_request(wrapped, instance, args, kwargs):
        bound = signature.bind(instance, *args, **kwargs).arguments
        req_id = str(getattr(bound[data_key], "req_id", ""))
        parked = req_id in getattr(instance, "_suspended", {})
        kept = instance.__dict__.get(HistoryLedger.ATTR, {}).pop(req_id, None) if parked else None
        result = wrapped(*args, **kwargs)
        if not parked:
            return result
        pending = getattr(instance, "_pending_history", None)
        fed = pending.get(bound[index_key]) if isinstance(pending, dict) else None
        if fed is None:
            if pending is None and kept is not None and not _no_pending.is_set():
                _no_pending.set()
                logger.warning("preemption-host-copy: the model state keeps no _pending_history; resumed "
                               "frames are not verified (%s)", env.RESUME_CHECK)
            return result  # preempted before its first frame: nothing to feed back
        state.count("resumes")
        if kept is not None:
            HistoryLedger.verify(instance, req_id, kept, fed)
        return result

    return function_wrapper(original, add_request)


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
    # add_request carries the resume check: it goes with the park it checks, unprobed.
    return replace_where_needed(ctx, parks_off_host, build, kind="method",
                                checking="where a preempted request is parked",
                                fixed="already copies the parked history and count to the host off CUDA",
                                companions={RESUME: build_resume})
