"""preemption-host-copy: a preempted Drama 3 request parks its generated codes on the host.

Record: ``patches_manifest.yaml``, id ``preemption-host-copy`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: ``build`` (a wrapt ``FunctionWrapper``) runs the original, then ``park_on_host``
replaces the parked ``PARKED`` tensors that ``needs_host_copy``. Feature detection
(``parks_off_host``) runs the method's own body, copied by ``_own_body`` with its ``super()``
pointed at ``_QuietParent``, on ``meta`` buffers.

The resume check (``DRAMA3_PATCHES_RESUME_CHECK=1``): before the published park runs,
``SlotReference.take`` copies the request's frames from the slot itself
(``slot_history[req_index, :slot_generated[req_index]]``, a few KB) to the host, and hangs the copy
on the parked record, so it lives exactly as long as upstream keeps the park (a finish or an
abort drops both). ``build_resume`` wraps ``add_request`` and compares what the published code
queued for the resumed slot (``_pending_history``) with that copy, raising
:class:`ResumedHistoryMismatch` on a difference. The reference never comes from what the park
produced, so a park that reads the wrong slot or alters the frames fails the check. The fed
length must equal the scheduler's count (``prefill_token_ids`` past the prompt); the reference's
may exceed that count by :func:`inflight_frames` only. Each process's report counts
``preemptions``, ``resumes`` and ``resumes_verified``.
"""

from __future__ import annotations

import inspect
import types
from types import SimpleNamespace

import torch

from drama3_patches import env
from drama3_patches.engine import state
from drama3_patches.logger import init_logger, warning_once
from drama3_patches.patchlib import PatchContext, function_wrapper, replace_where_needed

logger = init_logger(__name__)

PARKED = ("history", "count")
MODEL_STATE = "vllm_omni.model_executor.models.fish_omni.model_state:FishOmniModelState"
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


class SlotReference:
    """The resume check's reference: a host copy of a preempted request's frames, read from its
    slot before the published park runs, kept on the parked record (``ATTR``)."""

    ATTR = "_drama3_reference"

    @staticmethod
    def take(model_state, req_index: int) -> torch.Tensor | None:
        """``slot_history[req_index, :slot_generated[req_index]]`` on the host (a blocking copy: the
        count read syncs with the device, acceptable for an opt-in check), or None where the state
        has no slot pools to read."""
        buffers = getattr(model_state, "buffers", None)
        history = getattr(buffers, "slot_history", None)
        generated = getattr(buffers, "slot_generated", None)
        if not isinstance(history, torch.Tensor) or not isinstance(generated, torch.Tensor):
            return None
        frames = int(generated[req_index].to("cpu"))
        return history[req_index, :frames].to("cpu", copy=True)

    @classmethod
    def attach(cls, parked, reference: torch.Tensor) -> bool:
        try:
            setattr(parked, cls.ATTR, reference)
        except AttributeError:  # a parked record without a __dict__: nothing to hang it on
            return False
        return True

    @classmethod
    def of(cls, parked) -> torch.Tensor | None:
        return getattr(parked, cls.ATTR, None)

    @staticmethod
    def verify(req_id, reference: torch.Tensor, fed: torch.Tensor, generated: int, slack: int) -> None:
        """``fed``: the ``[frames, codebooks]`` history the resumed slot is given; ``generated``: the
        frames the scheduler counts as generated. ``fed`` must have exactly ``generated`` frames, the
        reference at most ``generated + slack`` (``slack``: :func:`inflight_frames`), and ``fed``
        must be the reference's first frames."""
        fed = fed.to("cpu")
        frames, kept = fed.shape[0], reference.shape[0]
        if frames != generated:
            raise ResumedHistoryMismatch(
                f"request {req_id}: resumed with {frames} frames of history, but the scheduler counts {generated} "
                f"generated frames ({env.RESUME_CHECK}=1). The request would continue from a history of another "
                "length than its own: stop the deployment and report it with this line")
        if kept > generated + slack:
            raise ResumedHistoryMismatch(
                f"request {req_id}: its slot held {kept} frames at preemption, more than the {generated} the "
                f"scheduler counts as generated plus {slack} that async scheduling can have in flight "
                f"({env.RESUME_CHECK}=1). Frames the request generated were lost from its count: stop the "
                "deployment and report it with this line")
        expected = reference[:frames].to(fed.dtype)
        if frames > kept or not torch.equal(fed, expected):
            same = min(frames, kept)
            bad = next((i for i in range(same) if not torch.equal(fed[i], expected[i])), same)
            raise ResumedHistoryMismatch(
                f"request {req_id}: resumed with {frames} frames of history, {kept} in its slot at "
                f"preemption; they differ from frame {bad} on ({env.RESUME_CHECK}=1). The request would "
                "continue from frames it never generated: stop the deployment and report it with this line")
        state.count("resumes_verified")


def inflight_frames(model_state) -> int | None:
    """How many frames a preempted request's slot may hold beyond what the scheduler counts as
    generated: one per step scheduled but not yet settled when the scheduler preempted it; None
    where the model state carries no ``vllm_config`` to read it from.

    From the published code (vLLM 0.32.0): the engine sizes its batch queue at
    ``max_concurrent_batches`` (``vllm/v1/engine/core.py:220``) and schedules a step only while
    fewer batches than that are queued (``core.py:720``), so at most ``max_concurrent_batches - 1``
    earlier steps are in flight at a preemption; the scheduler counts none of their frames until
    their output comes back (``_preempt_request`` marks them stale,
    ``vllm/v1/core/sched/scheduler.py:1606``), while the worker's slot already holds them when our
    reference is read. ``max_concurrent_batches`` is ``pipeline_parallel_size + 1`` with async
    scheduling on Model Runner V2, 2 with it on V1 at one stage, else ``pipeline_parallel_size``
    (``vllm/config/vllm.py:577``): 1 frame at one pipeline stage with async scheduling, 0 without.
    A fish_omni step samples one frame per request (one sample row per request,
    ``vllm_omni/model_executor/models/fish_omni/model_state.py:363``).
    """
    batches = getattr(getattr(model_state, "vllm_config", None), "max_concurrent_batches", None)
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        return None
    return batches - 1


def _inject_fault(model_state, parked, req_index: int) -> None:
    """Test-only (``DRAMA3_PATCHES_FAULT``): what each resume-check fault stands for."""
    if env.fault("parked-history"):
        # the slot's reuse scribbled over the parked frames
        frames = int(parked.count.reshape(-1)[0])
        if frames:
            parked.history[frames - 1, 0] += 1
    if env.fault("wrong-slot"):
        # a park that read the next slot's history instead of the request's own
        history = model_state.buffers.slot_history
        parked.history = history[(req_index + 1) % history.shape[0]].to("cpu", copy=True)


def build(original):
    signature = inspect.signature(original)
    names = list(signature.parameters)
    # The request id is the parking key, the index its slot: the published names, else by position.
    key = "req_id" if "req_id" in names else names[1]
    index_key = "req_index" if "req_index" in names else names[2]

    def on_request_preempted(wrapped, instance, args, kwargs):
        bound = signature.bind(instance, *args, **kwargs).arguments
        req_id, req_index = bound[key], bound[index_key]
        checking = env.resume_check()
        # Taken before the published park runs: what the slot holds, not what the park made of it.
        reference = SlotReference.take(instance, req_index) if checking else None
        result = wrapped(*args, **kwargs)
        park_on_host(instance, req_id)
        state.count("preemptions")
        parked = getattr(instance, "_suspended", {}).get(req_id)
        if checking and parked is not None and getattr(parked, "event", None) is None:
            if reference is not None and not SlotReference.attach(parked, reference):
                _warn_unverified("the parked record takes no attribute")
            _inject_fault(instance, parked, req_index)
        return result

    # Same signature as the published method: a FunctionWrapper, bound as the method was.
    return function_wrapper(original, on_request_preempted)


def _warn_unverified(why: str) -> None:
    warning_once(logger, f"unverified: {why}", "preemption-host-copy: %s; resumed frames are not verified (%s)", why,
                 env.RESUME_CHECK)


def build_resume(original):
    signature = inspect.signature(original)
    index_key, data_key = list(signature.parameters)[1:3]

    def add_request(wrapped, instance, args, kwargs):
        bound = signature.bind(instance, *args, **kwargs).arguments
        req_id = str(getattr(bound[data_key], "req_id", ""))
        parked = getattr(instance, "_suspended", {}).get(req_id)
        # Read before the published code consumes the park (it pops it from _suspended).
        reference = SlotReference.of(parked) if parked is not None else None
        result = wrapped(*args, **kwargs)
        if parked is None:
            return result
        pending = getattr(instance, "_pending_history", None)
        fed = pending.get(bound[index_key]) if isinstance(pending, dict) else None
        if fed is None:
            if pending is None and env.resume_check():
                _warn_unverified("the model state keeps no _pending_history")
            return result  # preempted before its first frame: nothing to feed back
        state.count("resumes")
        if reference is None:
            return result
        slack = inflight_frames(instance)
        if slack is None:
            # Without the bound the check is incomplete: the resume stays unverified in the counts.
            _warn_unverified("the model state has no vllm_config.max_concurrent_batches to bound the reference by")
            return result
        # What the scheduler counts as generated: the published add_request's own rule.
        data = bound[data_key]
        prompt = list(getattr(data, "prompt_token_ids", None) or ())
        generated = len(getattr(data, "prefill_token_ids", None) or prompt) - len(prompt)
        SlotReference.verify(req_id, reference, fed, generated, slack)
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
