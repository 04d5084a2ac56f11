"""A simulated ``npu`` device for tests on hosts without an Ascend card.

What it gives (after :func:`enable`):

* ``torch.device("npu")`` is valid: PrivateUse1 is renamed to ``npu``
  (``torch.utils.rename_privateuse1_backend``) and set up as a Python backend.
* Tensors made on ``npu`` (``torch.empty/zeros/full(..., device="npu")``,
  ``t.to("npu")``, ``t.npu()``, :func:`to_npu`) are :class:`FakeNpuTensor`:
  ``device.type == "npu"``, ``is_cuda is False``, ``is_npu is True``. Their
  data lives in a private CPU tensor; every aten op runs on it and the result
  is wrapped again, so views, in-place ops and ``clone()`` stay on ``npu``.
* Leaving the device is explicit, as on a real card: ``.to("cpu")``,
  ``.cpu()``, ``cpu_tensor.copy_(npu_tensor)``.
* Mixing with CPU tensors raises ``RuntimeError("Expected all tensors to be on
  the same device ...")`` like a real device does, in ``torch.cat``,
  arithmetic, ``index_copy``, ``torch.equal`` ...  Exceptions, as on CUDA:
  0-dim CPU tensors act as scalars in arithmetic, CPU index tensors are
  accepted by advanced indexing (``x[idx]``, ``x[idx] = v``), and copies.
* :func:`record_transfers` records every host<->device copy with its
  ``non_blocking`` flag, so a test can check how data left the device.
* ``torch.npu`` answers ``is_available``, ``device_count``, ``current_device``,
  ``synchronize``, ``Event``, ``Stream``, ``current_stream`` and ``stream``
  (all trivially: the simulated device is synchronous).

Limits: single device (``npu:0``); no autograd; no pinned memory; ``out=``
arguments that would be resized are not supported.  Copies are synchronous
(a real ``non_blocking`` copy to pinned memory is not).

``enable()`` changes process-wide torch state that cannot be undone (the
backend name, ``torch.npu``, ``Tensor.npu``).  Tests that use it run in a
forked process: mark them ``@pytest.mark.forked`` (pytest-forked).
:func:`vllm_on_npu` also makes vLLM's current platform an ``npu`` one first.

Use::

    from support import fake_npu

    @pytest.mark.forked
    def test_something():
        fake_npu.enable()
        x = torch.arange(4).to("npu")     # FakeNpuTensor on npu:0
        with pytest.raises(RuntimeError, match="same device"):
            torch.cat([x, torch.arange(2)])
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "DEVICE",
    "FakeNpuTensor",
    "Transfer",
    "enable",
    "is_fake_npu",
    "record_transfers",
    "SaysCuda",
    "to_npu",
    "vllm_on_npu",
]

DEVICE = "npu:0"  # a string: torch.device("npu") is only valid after enable()
_ENABLED = False
_LIB = None  # keeps the aten registrations alive
_TRANSFER_LOGS: list[list["Transfer"]] = []

_aten = torch.ops.aten
# Ops that may legally see npu and cpu tensors together.
_COPY_OPS = {_aten.copy_.default, _aten._to_copy.default}
_INDEX_OPS = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default}


class Transfer(tuple):
    """``(direction, non_blocking)``; direction is ``"d2h"``, ``"h2d"`` or ``"d2d"``."""

    __slots__ = ()

    def __new__(cls, direction: str, non_blocking: bool):
        return super().__new__(cls, (direction, bool(non_blocking)))

    @property
    def direction(self) -> str:
        return self[0]

    @property
    def non_blocking(self) -> bool:
        return self[1]


def _log(direction: str, non_blocking: bool) -> None:
    for log in _TRANSFER_LOGS:
        log.append(Transfer(direction, non_blocking))


@contextlib.contextmanager
def record_transfers() -> Iterator[list[Transfer]]:
    """Collect the host/device copies made inside the block."""
    log: list[Transfer] = []
    _TRANSFER_LOGS.append(log)
    try:
        yield log
    finally:
        _TRANSFER_LOGS.remove(log)


def _is_npu_device(device: Any) -> bool:
    return device is not None and torch.device(device).type == "npu"


class FakeNpuTensor(torch.Tensor):
    """A tensor on the simulated ``npu`` device (data kept in ``_data`` on CPU)."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        assert type(data) is torch.Tensor and data.device.type == "cpu"
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=torch.device(DEVICE),
            requires_grad=False,
        )
        r._data = data
        return r

    # Only the aten level is intercepted: torch functions decompose to it.
    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105
        return f"FakeNpuTensor({self._data!r}, device='{self.device}')"

    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, new):
        # `param.data = x` (common in weight post-processing) swaps the tensor's metadata in
        # C++; the private CPU buffer has to follow, or reads would still see the old values.
        if not isinstance(new, FakeNpuTensor):
            raise RuntimeError(f"the simulated npu cannot take .data from a {new.device} tensor; copy it first")
        torch.Tensor.data.__set__(self, new)
        self._data = new._data

    def tolist(self):  # a real device answers tolist() with an implicit device-to-host copy
        _log("d2h", False)
        return self._data.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is _aten.copy_.default:
            return _copy(args[0], args[1], bool(kwargs.get("non_blocking", len(args) > 2 and args[2])))
        if func is _aten._to_copy.default:
            return _to_copy(args[0], kwargs)
        _check_same_device(func, args, kwargs)
        by_id = {}

        def unwrap(t):
            if isinstance(t, FakeNpuTensor):
                by_id[id(t._data)] = t
                return t._data
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if "device" in kwargs and not _is_npu_device(kwargs["device"]):
            return out  # e.g. empty_like(x, device="cpu")

        def wrap(t):
            if type(t) is torch.Tensor:
                # In-place and out= ops return their input: give back the same wrapper.
                same = by_id.get(id(t))
                return same if same is not None else FakeNpuTensor(t)
            return t

        return tree_map(wrap, out)


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    d_npu, s_npu = isinstance(dst, FakeNpuTensor), isinstance(src, FakeNpuTensor)
    _log({(True, True): "d2d", (True, False): "h2d", (False, True): "d2h"}[(d_npu, s_npu)], non_blocking)
    (dst._data if d_npu else dst).copy_(src._data if s_npu else src)
    return dst


def _to_copy(src: FakeNpuTensor, kwargs: dict) -> torch.Tensor:
    device = kwargs.pop("device", None)
    non_blocking = bool(kwargs.pop("non_blocking", False))
    if kwargs.pop("pin_memory", None):
        raise RuntimeError("the simulated npu device has no pinned memory")
    out = _aten._to_copy.default(src._data, **kwargs)
    if out is src._data:  # _to_copy always copies; keep our own buffer private anyway
        out = out.clone()
    if device is not None and not _is_npu_device(device):
        _log("d2h", non_blocking)
        return out
    _log("d2d", non_blocking)
    return FakeNpuTensor(out)


def _check_same_device(func, args, kwargs) -> None:
    flat, _ = tree_flatten((args, kwargs))
    if func in _INDEX_OPS:
        # CPU index tensors are fine for advanced indexing, as on CUDA.
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        skip = {id(i) for i in indices if isinstance(i, torch.Tensor)}
        flat = [t for t in flat if id(t) not in skip]
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    on_cpu = [t for t in tensors if not isinstance(t, FakeNpuTensor) and t.device.type == "cpu"]
    if not on_cpu or len(on_cpu) == len(tensors):
        return
    # A 0-dim CPU tensor is a scalar operand for elementwise math, not for cat & co.
    if all(t.dim() == 0 for t in on_cpu) and func not in (_aten.cat.default, _aten.stack.default):
        return
    raise RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{DEVICE} and cpu! (when checking arguments for {func})"
    )


def is_fake_npu(t: Any) -> bool:
    return isinstance(t, FakeNpuTensor)


def to_npu(t: torch.Tensor) -> FakeNpuTensor:
    """Copy a CPU tensor to the simulated device (same as ``t.to("npu")``)."""
    enable()
    return t.to(DEVICE)


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return FakeNpuTensor(torch.empty(size, dtype=dtype, memory_format=memory_format))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return FakeNpuTensor(torch.empty_strided(size, stride, dtype=dtype))


def _copy_from(src, dst, non_blocking=False):
    # Reached when torch builds an npu tensor below the Python dispatch key (torch.tensor(..., device=)).
    return _copy(dst, src, non_blocking)


class Event:
    """``torch.npu.Event`` stand-in: the simulated device finishes work at once."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        pass


class Stream:
    """``torch.npu.Stream`` stand-in (one in-order queue, always idle)."""

    def __init__(self, device=None, priority: int = 0) -> None:
        self.device = device

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event


_DEFAULT_STREAM = Stream()


def _device_module() -> types.ModuleType:
    mod = types.ModuleType("torch.npu", "simulated npu device module (tests only)")
    mod.Event, mod.Stream = Event, Stream
    mod.current_stream = lambda device=None: _DEFAULT_STREAM
    mod.default_stream = lambda device=None: _DEFAULT_STREAM
    mod.stream = lambda stream: contextlib.nullcontext(stream)
    mod.is_available = lambda: True
    mod.is_initialized = lambda: True
    mod._is_in_bad_fork = lambda: False
    mod.device_count = lambda: 1
    mod.current_device = lambda: 0
    mod.set_device = lambda device: None
    mod.manual_seed_all = lambda seed: None
    mod.synchronize = lambda device=None: None  # every simulated copy is synchronous
    return mod


def enable() -> None:
    """Register the simulated ``npu`` device in this process (idempotent, irreversible)."""
    global _ENABLED, _LIB
    if _ENABLED:
        return
    current = torch._C._get_privateuse1_backend_name()
    if current != "privateuseone":
        # Also the case when this file was imported under a second module name.
        raise RuntimeError(
            f"PrivateUse1 is already set up as {current!r} in this process; import this module once, "
            "as `from support import fake_npu`"
        )
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename="npu", backend_module=_device_module())
    _LIB = torch.library.Library("aten", "IMPL")
    _LIB.impl("empty.memory_format", _empty, "PrivateUse1")
    _LIB.impl("empty_strided", _empty_strided, "PrivateUse1")
    _LIB.impl("_copy_from", _copy_from, "PrivateUse1")
    _ENABLED = True


class SaysCuda:
    """A vLLM platform that answers ``is_cuda()`` with True and is ``real`` otherwise: the case a
    patch that keys on vLLM's platform check must handle (no CUDA here)."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def is_cuda(self) -> bool:
        return True


def vllm_on_npu() -> None:
    """As far as vLLM and vllm-omni can tell, this process is an Ascend worker (forked tests only).

    vLLM's current platform becomes an out-of-tree ``npu`` one (the ``_enum`` / ``device_type`` /
    ``dispatch_key`` of vLLM-Ascend's) without pinned memory, whose ``current_device`` is the
    host (where layers put small weights the simulated device need not hold); vllm-omni is
    imported while ``torch.npu`` does not exist yet, so it resolves no NPU platform of its own
    (that one imports vllm-ascend); then the simulated device is enabled, so
    ``torch.device("npu")`` and ``DeviceConfig(device="npu")`` are valid.
    """
    import vllm.platforms as vllm_platforms
    from vllm.platforms.interface import Platform, PlatformEnum

    class SimulatedNpuPlatform(Platform):
        _enum = PlatformEnum.OOT
        device_name = "npu"
        device_type = "npu"
        dispatch_key = "PrivateUse1"

        @classmethod
        def current_device(cls):
            return torch.device("cpu")

        @classmethod
        def is_pin_memory_available(cls) -> bool:
            return False

    vllm_platforms._current_platform = SimulatedNpuPlatform()
    # vLLM caches answers derived from the platform (is_pin_memory_available, is_uva_available)
    # for the process; a forked test inherits the answers the CPU platform gave its parent.
    import vllm.utils.platform_utils as platform_utils

    for value in vars(platform_utils).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    import vllm_omni  # noqa: F401

    enable()
