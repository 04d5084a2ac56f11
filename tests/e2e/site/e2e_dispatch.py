"""Test-only: what stage 0 dispatches in each engine step, by component and by this project's kernel.

Active in a process when ``DRAMA3_E2E_DISPATCH`` names a file (``sitecustomize`` installs the
import hooks below; a step opens around vLLM-Omni's Model Runner V2 AR runner's
``execute_model`` and goes on through its ``sample_tokens``, on any platform: the CPU workers
here, vLLM-Ascend's on the cards). Each step is appended to that file as one JSON line, with the
worker's tensor-parallel rank.

Counting is ``support.launches``' (every aten op the step dispatches, classed as launch, view,
alloc or host sync, composite ops counted as what they decompose into). Attribution:

* the component is the innermost labelled region: the model's forward (``forward: frames and
  glue``), its backbone (``backbone: GDN mixer`` / ``full attention`` / ``MoE`` / ``norms and
  rest``), the tower's shared and per-codebook layers, the codebook heads, the frame sampler
  (``FusedFrameSampler``'s draws); outside the forward, ``model state`` (a frame of
  fish_omni's ``model_state.py`` or of a drama3 patch on the stack) or ``runner``;
* the kernel is the outermost of this project's eager kernels on the call (``tower-sampler-eager``'s
  and qwen3next's), wrapped where their modules are first imported, so every patch binds the
  wrapped function;
* a Triton kernel (Model Runner V2's bookkeeping, run by Triton's interpreter here) counts as one
  launch named ``triton:<kernel>``; the interpreter's own tensor ops are not counted;
* a host sync records where it happened: the first frame outside torch and this probe.

Steps run outside ``execute_model`` (vLLM's profile and warm-up runs) are not recorded.

With ``DRAMA3_E2E_FUSED_STANDIN=1`` as well, the kernels' fused-norm detection
(``drama3_patches.kernels.npu_fused.fused_norms``) answers ``support.fused_standin``'s one-op
CPU stand-ins for torch-npu's norms, so the count is the one an NPU with them would dispatch.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

OUT_ENV = "DRAMA3_E2E_DISPATCH"
STANDIN_ENV = "DRAMA3_E2E_FUSED_STANDIN"
FUSED_MODULE = "drama3_patches.kernels.npu_fused"
MODEL_MODULE = "vllm_omni.model_executor.models.fish_omni.fish_omni_model"
RUNNER_MODULE = "vllm_omni.worker_v2.omni_ar_model_runner"
SAMPLING_MODULE = "vllm_omni.model_executor.models.fish_omni.sampling"
# This project's eager kernels, by module: the entry points its patches bind.
KERNEL_MODULES = {
    "drama3_patches.kernels.norms": ("gemma_rms_norm", "gemma_rms_norm_table", "tower_mix_norm"),
    "drama3_patches.kernels.gating": ("sigmoid_gate",),
    "drama3_patches.kernels.sampling": ("draw_top_k_top_p",),
    "drama3_patches.kernels.qk_norm_rope_gate": ("fused_qk_rmsnorm_rope_gate", "qk_norm_rope_gate"),
}
TOWER = ("tower: shared layers", "tower: codebook layers", "tower: codebook heads", "sampler")
_TESTS = Path(__file__).resolve().parents[2]
_HERE = str(Path(__file__).resolve())

_labels: list = []
_kernel: list = [None]
_triton_depth = [0]
_step: dict | None = None
_counter = None


# -- attribution ------------------------------------------------------------------------------------

def _outside_label() -> str:
    frame = sys._getframe(3)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith("fish_omni/model_state.py") or "/drama3_patches/patches/" in name:
            return "model state"
        frame = frame.f_back
    return "runner"


def _where() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and name != _HERE and not name.endswith("support/launches.py"):
            short = name.split("site-packages/", 1)[-1]
            return f"{short}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _tests_on_path() -> None:
    # support.* lives in tests/, which the engine's processes may not have on sys.path
    if str(_TESTS) not in sys.path:
        sys.path.insert(0, str(_TESTS))


def _counter_class():
    _tests_on_path()
    from support.launches import LaunchCounter

    class StepCounter(LaunchCounter):
        def record(self, func, kind):
            if _triton_depth[0] or _step is None:
                return
            component = _labels[-1] if _labels else _outside_label()
            _add(component, _kernel[0], kind, func.overloadpacket.__name__)
            if kind == "syncs":
                _step["syncs"].append({"component": component, "op": str(func), "at": _where()})

    return StepCounter


def _add(component: str, kernel, kind: str, op: str) -> None:
    row = _step["rows"][f"{component}|{kernel or ''}"]
    row[kind] += 1
    if kind == "launches":
        _step["by_op"][component][op] += 1


# -- steps ------------------------------------------------------------------------------------------

def _flush() -> None:
    global _step
    if _step is None:
        return
    record = {k: v for k, v in _step.items() if k not in ("rows", "by_op")}
    record["rows"] = {k: dict(v) for k, v in _step["rows"].items()}
    record["by_op"] = {k: dict(v) for k, v in _step["by_op"].items()}
    with open(os.environ[OUT_ENV], "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    _step = None


class _Part:
    """One part of a step (``execute_model`` opens a new step, ``sample_tokens`` continues it)."""

    def __init__(self, scheduler_output=None):
        self._scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
        self._new = scheduler_output is not None

    def __enter__(self):
        global _step, _counter
        if self._new:
            _flush()
            scheduled = dict(self._scheduled or {})
            _step = {"pid": os.getpid(), "rank": _rank(), "requests": len(scheduled), "tokens": sum(scheduled.values()),
                     "decode": bool(scheduled) and all(n == 1 for n in scheduled.values()),
                     "rows": defaultdict(Counter), "by_op": defaultdict(Counter),
                     "kernel_calls": Counter(), "syncs": []}
        if _step is None:
            self._mode = None
            return self
        if _counter is None:
            _counter = _counter_class()
            _wrap_triton()
        _labels.clear()
        self._mode = _counter()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            self._mode.__exit__(*exc)
        return False


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def step(scheduler_output=None) -> _Part:
    """``with step(scheduler_output):`` around ``execute_model``; ``with step():`` around ``sample_tokens``."""
    return _Part(scheduler_output)


# -- hooks ------------------------------------------------------------------------------------------

def _push(label):
    def pre(module, args):
        _labels.append(label)
    return pre


def _pop(module, args, output):
    if _labels:
        _labels.pop()


def _label_module(module, label: str) -> None:
    module.register_forward_pre_hook(_push(label))
    module.register_forward_hook(_pop)


def _label_model(model) -> None:
    for layer in getattr(model.model, "layers", []):
        layer_type = getattr(layer, "layer_type", None)
        if layer_type is None:
            continue
        _label_module(layer, "backbone: norms and rest")
        if hasattr(layer, "linear_attn"):
            _label_module(layer.linear_attn, "backbone: GDN mixer")
        if hasattr(layer, "self_attn"):
            _label_module(layer.self_attn, "backbone: full attention")
        if hasattr(layer, "mlp"):
            _label_module(layer.mlp, "backbone: MoE" if hasattr(layer.mlp, "experts") else "backbone: MLP")
    _label_module(model.model, "backbone: norms and rest")
    for index, layer in enumerate(model.tower_layers):
        shared = index < model.num_shared_layers
        _label_module(layer, "tower: shared layers" if shared else "tower: codebook layers")
    for head in model.codebook_heads:
        if hasattr(head, "register_forward_pre_hook"):
            _label_module(head, "tower: codebook heads")


def _wrap_runner(module) -> None:
    cls = module.OmniARModelRunner
    execute, sample = cls.execute_model, cls.sample_tokens

    @functools.wraps(execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        if kwargs.get("dummy_run"):
            return execute(self, scheduler_output, *args, **kwargs)
        with step(scheduler_output):
            return execute(self, scheduler_output, *args, **kwargs)

    @functools.wraps(sample)
    def sample_tokens(self, *args, **kwargs):
        with step():
            return sample(self, *args, **kwargs)

    cls.execute_model, cls.sample_tokens = execute_model, sample_tokens


def _wrap_forward(module) -> None:
    cls = module.FishOmniForConditionalGeneration
    original = cls.forward

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if not getattr(self, "_e2e_dispatch_labelled", False):
            _label_model(self)
            self._e2e_dispatch_labelled = True
        _labels.append("forward: frames and glue")
        try:
            return original(self, *args, **kwargs)
        finally:
            if _labels:
                _labels.pop()

    cls.forward = forward


def _wrap_sampler(module) -> None:
    cls = module.FusedFrameSampler
    for name in ("main_tokens", "code"):
        original = getattr(cls, name)

        def method(self, *args, _original=original, **kwargs):
            _labels.append("sampler")
            try:
                return _original(self, *args, **kwargs)
            finally:
                _labels.pop()

        setattr(cls, name, functools.wraps(original)(method))


def _wrap_kernels(module) -> None:
    for name in KERNEL_MODULES[module.__name__]:
        original = getattr(module, name)

        def kernel(*args, _original=original, _name=name, **kwargs):
            if _kernel[0] is not None:  # a kernel called by another: the outer one's
                return _original(*args, **kwargs)
            _kernel[0] = _name
            if _step is not None:
                _step["kernel_calls"][_name] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                _kernel[0] = None

        setattr(module, name, functools.wraps(original)(kernel))


def _wrap_triton() -> None:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        fn = getattr(self, "fn", None)
        if _step is not None and not _triton_depth[0]:
            component = _labels[-1] if _labels else "runner"
            _add(component, f"triton:{getattr(fn, '__qualname__', '?')}", "launches", "triton")
        _triton_depth[0] += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _triton_depth[0] -= 1

    InterpretedFunction.run = run


def _stand_in_fused(module) -> None:
    _tests_on_path()
    from support.fused_standin import STAND_IN

    module.fused_norms = lambda device: STAND_IN


def after_exec_hooks() -> dict:
    """module name -> what to run on it after its body ran (for ``sitecustomize``'s finder)."""
    hooks = {RUNNER_MODULE: _wrap_runner, MODEL_MODULE: _wrap_forward, SAMPLING_MODULE: _wrap_sampler}
    hooks.update({name: _wrap_kernels for name in KERNEL_MODULES})
    if os.environ.get(STANDIN_ENV) == "1":
        hooks[FUSED_MODULE] = _stand_in_fused
    return hooks


atexit.register(_flush)
