"""preemption-host-copy on the port's FishOmniModelState replica, with the simulated npu device."""

from __future__ import annotations

import importlib.util
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from drama3_patches.patches import preemption_host_copy as php
from drama3_patches.patchlib import NotNeeded, PatchContext
from support import fake_npu

PROFILE = Path(__file__).resolve().parent / "replicas" / "omni_032"
MODULE = "vllm_omni.worker_v2.model_states.fish_omni_model_state"
TARGET = f"{MODULE}:FishOmniModelState.on_request_preempted"
CODEBOOKS, SLOTS, MAX_FRAMES = 10, 4, 32


def _load_replica():
    """The replica module under a private name: no sys.path or sys.modules change."""
    path = PROFILE / (MODULE.replace(".", "/") + ".py")
    spec = importlib.util.spec_from_file_location("_fish_omni_model_state_replica", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _frames(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4096, (n, CODEBOOKS), dtype=torch.int64, generator=g)


def _generate(state, slot: int, steps: int, seed: int) -> torch.Tensor:
    """Decode ``steps`` steps of 1-3 frames into ``slot``; returns every frame written (host)."""
    written = []
    for step in range(steps):
        frames = _frames(1 + (seed + step) % 3, seed * 100 + step)
        state.append_frames(slot, frames.to(state.device))
        written.append(frames)
    return torch.cat(written)


def _scenario(state_cls, device: str):
    """Generate, preempt, reuse the old slot for another request, resume elsewhere, finish."""
    state = state_cls(SLOTS, MAX_FRAMES, CODEBOOKS, device=device)
    state.add_request(1, SimpleNamespace(req_id="A"))
    saved = _generate(state, 1, steps=6, seed=3)
    state.on_request_preempted("A", 1)
    parked = state._suspended["A"]
    refs = [weakref.ref(parked["history"]), weakref.ref(parked["count"])]
    parked = None
    state.remove_request(1)  # the runner frees the slot ...
    state.add_request(1, SimpleNamespace(req_id="B"))  # ... and the scheduler reuses it
    other = _generate(state, 1, steps=9, seed=8)
    state.add_request(3, SimpleNamespace(req_id="A"))  # resume in a different slot
    return state, saved, other, refs


def test_cpu_state_parks_independent_snapshots_unpatched_and_patched():
    mod = _load_replica()
    patched = php.build(mod.FishOmniModelState.on_request_preempted)
    for method in (mod.FishOmniModelState.on_request_preempted, patched):
        state = mod.FishOmniModelState(SLOTS, MAX_FRAMES, CODEBOOKS)
        state.add_request(0, SimpleNamespace(req_id="A"))
        saved = _generate(state, 0, steps=4, seed=1)
        method(state, "A", 0)
        state.history[0].fill_(-7)  # the slot is reused: the snapshot must not follow
        state.history_count[0].fill_(99)
        parked = state._suspended["A"]
        assert parked["history"].device.type == "cpu"
        assert int(parked["count"]) == saved.shape[0]
        assert torch.equal(parked["history"][: saved.shape[0]], saved)


def test_clone_redirect_leaves_cpu_meta_and_cuda_tensors_alone():
    cpu = torch.arange(4)
    meta = torch.empty(4, device="meta")
    assert not php.needs_host_copy(cpu) and not php.needs_host_copy(meta) and not php.needs_host_copy(3)
    calls = []

    class CudaLike(torch.Tensor):
        """Reports a CUDA device; records what reaches the dispatcher."""

        @staticmethod
        def __new__(cls, data):
            r = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=torch.device("cuda", 0))
            r.data_ = data
            return r

        __torch_function__ = torch._C._disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return CudaLike(args[0].data_.clone())

    t = CudaLike(torch.arange(3))
    assert t.is_cuda and not php.needs_host_copy(t)
    with php.HostCopyClones() as mode:
        out = t.clone()
        also = cpu.clone()
    assert isinstance(out, CudaLike) and out.device.type == "cuda"  # the CUDA path: a plain clone
    assert calls == [torch.ops.aten.clone.default] and mode.host_copies == 0
    assert also.device.type == "cpu" and also.data_ptr() != cpu.data_ptr()


def test_plan_wraps_once_and_detects_an_upstream_fix():
    mod = _load_replica()

    def resolve(target):
        return mod.FishOmniModelState.__dict__["on_request_preempted"]

    ctx = PatchContext("preemption-host-copy", (TARGET,), "npu", {}, php.logger, _resolve=resolve)
    out = php.plan(ctx)
    new = out[TARGET]
    assert new.__wrapped__ is mod.FishOmniModelState.on_request_preempted
    assert new.__qualname__ == "FishOmniModelState.on_request_preempted"

    class Fixed:
        def on_request_preempted(self, req_id, req_index):
            self.parked = self.history[req_index].to("cpu", non_blocking=False, copy=True)

    ctx = PatchContext("preemption-host-copy", (TARGET,), "npu", {}, php.logger,
                       _resolve=lambda t: Fixed.__dict__["on_request_preempted"])
    with pytest.raises(NotNeeded, match="no clone"):
        php.plan(ctx)


@fake_npu.in_fresh_process
def test_unpatched_port_fails_at_resume_on_npu():
    """The original bug: the clone() stays on the device; resume concatenates it with host tensors."""
    fake_npu.enable()
    mod = _load_replica()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        _scenario(mod.FishOmniModelState, "npu")


def _check_resumed(state, saved, other, refs):
    n = saved.shape[0]
    history = state.history.cpu()
    counts = state.history_count.cpu()
    assert int(counts[3]) == n and torch.equal(history[3, :n], saved)  # every code, bit for bit
    assert torch.count_nonzero(history[3, n:]) == 0
    assert int(counts[1]) == other.shape[0] and torch.equal(history[1, : other.shape[0]], other)
    assert "A" not in state._suspended and all(r() is None for r in refs)  # resume consumed the park
    state.remove_request("A")  # completion
    assert state._suspended == {} and "A" not in state.req_id_to_index


@fake_npu.in_fresh_process
def test_patched_by_the_engine_parks_on_host_and_resumes_bit_exact(monkeypatch):
    fake_npu.enable()
    monkeypatch.setenv("DRAMA3_PATCHES", "1")
    monkeypatch.setenv("DRAMA3_PATCHES_PLATFORM", "npu")
    monkeypatch.setenv("DRAMA3_PATCHES_STRICT", "1")
    sys.path.insert(0, str(PROFILE))  # fresh process: nothing to undo
    import drama3_patches

    drama3_patches.apply(["preemption-host-copy"])
    from vllm_omni.worker_v2.model_states.fish_omni_model_state import FishOmniModelState

    row = {p["id"]: p for p in drama3_patches.status()["patches"]}["preemption-host-copy"]
    assert row["state"] == "applied", row
    assert FishOmniModelState.on_request_preempted.__wrapped__ is drama3_patches.get_original(TARGET)

    with fake_npu.record_transfers() as log:
        state = FishOmniModelState(SLOTS, MAX_FRAMES, CODEBOOKS, device="npu")
        state.add_request(1, SimpleNamespace(req_id="A"))
        saved = _generate(state, 1, steps=6, seed=3)
        del log[:]
        state.on_request_preempted("A", 1)
        park_copies = list(log)
    # history and count left the device with blocking copies, before the method returned
    assert [(t.direction, t.non_blocking) for t in park_copies] == [("d2h", False), ("d2h", False)]
    parked = state._suspended["A"]
    assert not fake_npu.is_fake_npu(parked["history"]) and parked["history"].device.type == "cpu"
    assert not fake_npu.is_fake_npu(parked["count"]) and int(parked["count"]) == saved.shape[0]
    parked = None

    state, saved, other, refs = _scenario(FishOmniModelState, "npu")
    _check_resumed(state, saved, other, refs)

    # A request finished while parked drops its host copy too.
    state.add_request(2, SimpleNamespace(req_id="C"))
    _generate(state, 2, steps=2, seed=5)
    state.on_request_preempted("C", 2)
    ref = weakref.ref(state._suspended["C"]["history"])
    state.remove_request("C")
    assert "C" not in state._suspended and ref() is None

    drama3_patches.unapply(["preemption-host-copy"])
    assert not hasattr(FishOmniModelState.on_request_preempted, "__wrapped__")
    with pytest.raises(RuntimeError, match="same device"):
        _scenario(FishOmniModelState, "npu")


@fake_npu.in_fresh_process
def test_patched_method_on_npu_without_the_engine():
    # The same guarantees from the replacement alone (what plan() returns), on a second layout.
    fake_npu.enable()
    mod = _load_replica()

    class Patched(mod.FishOmniModelState):
        pass

    Patched.on_request_preempted = php.build(mod.FishOmniModelState.on_request_preempted)
    state, saved, other, refs = _scenario(Patched, "npu")
    _check_resumed(state, saved, other, refs)


@pytest.mark.npu
def test_on_a_real_npu_resume_after_preemption_is_bit_exact():
    """Ascend host only: the same scenario on torch_npu tensors, with the patch applied."""
    import torch_npu  # noqa: F401

    mod = _load_replica()

    class Patched(mod.FishOmniModelState):
        pass

    Patched.on_request_preempted = php.build(mod.FishOmniModelState.on_request_preempted)
    state, saved, other, refs = _scenario(Patched, "npu")
    torch.npu.synchronize()
    _check_resumed(state, saved, other, refs)
    with pytest.raises(RuntimeError):
        _scenario(mod.FishOmniModelState, "npu")
