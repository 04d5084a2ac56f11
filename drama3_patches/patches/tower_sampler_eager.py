"""tower-sampler-eager: Drama 3's Triton entry points run eager torch off CUDA.

Record: ``patches_manifest.yaml``, id ``tower-sampler-eager`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: ``KERNELS`` maps each target's name to its eager kernel in ``drama3_patches.kernels``;
``kernel_for`` loads it and fails the patch, naming both, when its parameters (``_shape``:
names, kinds, defaults) differ from the target's. ``_build`` dispatches on the first tensor
argument. Feature detection (``upstream_dispatch``) runs ``_probe_copy`` of the entry point,
whose module-level Triton kernels are replaced by ``_NoLaunch`` (raising ``_Launch``), on the
``_probe_calls`` arguments made of ``meta`` tensors.
"""

from __future__ import annotations

import inspect
import pkgutil
import sys
import types

from drama3_patches.logger import init_logger
from drama3_patches.patchlib import PatchContext, wrap

logger = init_logger(__name__)

#: Target function name -> its eager kernel (``module:function``).
KERNELS = {
    "tower_mix_norm": "drama3_patches.kernels.norms:tower_mix_norm",
    "gemma_rms_norm": "drama3_patches.kernels.norms:gemma_rms_norm",
    "gemma_rms_norm_table": "drama3_patches.kernels.norms:gemma_rms_norm_table",
    "sigmoid_gate": "drama3_patches.kernels.gating:sigmoid_gate",
    "draw_top_k_top_p": "drama3_patches.kernels.sampling:draw_top_k_top_p",
    "fused_qk_rmsnorm_rope_gate": "drama3_patches.kernels.qk_norm_rope_gate:fused_qk_rmsnorm_rope_gate",
}


def _shape(func) -> tuple:
    """What a caller relies on: parameter names, kinds and defaults, in order (not annotations)."""
    return tuple((p.name, p.kind, p.default) for p in inspect.signature(func).parameters.values())


def _plain(func) -> str:
    """The signature as a caller sees it (annotations left out of messages)."""
    sig = inspect.signature(func)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def kernel_for(target: str, original):
    """The eager kernel for ``target``; ``TypeError`` naming both when there is none or it no longer fits."""
    name = target.rpartition(":")[2].rpartition(".")[2]
    path = KERNELS.get(name)
    if path is None:
        raise TypeError(f"{target}: no eager kernel is named {name!r} (known: {', '.join(KERNELS)})")
    kernel = pkgutil.resolve_name(path)
    if _shape(original) != _shape(kernel):
        raise TypeError(
            f"{target}{_plain(original)} no longer fits its eager kernel {path}{_plain(kernel)}"
        )
    return kernel


# -- feature detection --------------------------------------------------------


class _Launch(Exception):
    pass


class _NoLaunch:
    """Stands in for a Triton kernel in the probe: launching it raises ``_Launch``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid):
        raise _Launch(self.name)

    def run(self, *args, **kwargs):
        raise _Launch(self.name)

    __call__ = run


def _is_triton_kernel(value) -> bool:
    jit = sys.modules.get("triton.runtime.jit")
    return jit is not None and isinstance(value, jit.KernelInterface)


def _with_globals(func: types.FunctionType, namespace: dict) -> types.FunctionType:
    copy = types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


def _probe_copy(func: types.FunctionType) -> types.FunctionType:
    """``func`` and its module's functions over a copy of the module namespace whose kernels cannot launch."""
    home = func.__globals__
    namespace = dict(home)
    for name, value in home.items():
        if _is_triton_kernel(value):
            namespace[name] = _NoLaunch(name)
        elif isinstance(value, types.FunctionType) and value.__globals__ is home:
            namespace[name] = _with_globals(value, namespace)
    return _with_globals(func, namespace)


def _meta(*shape, dtype=None):
    import torch

    return torch.zeros(shape, dtype=dtype or torch.bfloat16, device="meta")


def _probe_calls(name: str) -> list[tuple]:
    """Small valid calls per entry point, on ``meta`` tensors (every branch the model uses)."""
    import torch

    rows, dim = 2, 8
    x, w = _meta(rows, dim), _meta(dim, dtype=torch.float32)
    code, mask = _meta(rows, dtype=torch.int64), _meta(rows, dtype=torch.bool)
    table = _meta(3, dim)
    if name == "tower_mix_norm":
        return [(x, code, mask, table, None, w, w, 1e-6), (x, code, mask, table, x, w, w, 1e-6)]
    if name == "gemma_rms_norm":
        return [(x, w, 1e-6), (x, w, 1e-6, x)]
    if name == "gemma_rms_norm_table":
        return [(x, code, mask, table, w, 1e-6)]
    if name == "sigmoid_gate":
        return [(x, x)]
    if name == "draw_top_k_top_p":
        f32, i64 = torch.float32, torch.int64
        logits, per_row = _meta(rows, 16, dtype=f32), _meta(rows, dtype=f32)
        top = (_meta(rows, 4, dtype=f32), _meta(rows, 4, dtype=i64))
        base = (logits, per_row, _meta(rows, dtype=i64), per_row, _meta(rows, 4, dtype=f32), 4)
        return [base, (*base, _meta(16, dtype=i64), top)]
    if name == "fused_qk_rmsnorm_rope_gate":
        heads, kv_heads, head_dim, rotary_dim = 2, 1, 8, 4
        args = (_meta(rows, heads * 2 * head_dim), _meta(rows, kv_heads * head_dim), w, w,
                _meta(16, rotary_dim, dtype=torch.float32), _meta(rows, dtype=torch.int64), 1e-6,
                heads, kv_heads, head_dim, rotary_dim)
        return [args, (*args, None, 1.0)]
    return []


def upstream_dispatch(name: str, original) -> str | None:
    """Why ``original`` needs no patch (it runs off CUDA without a Triton launch), or None."""
    calls = _probe_calls(name)
    if not isinstance(original, types.FunctionType) or not calls:
        return None
    probe = _probe_copy(original)
    for args in calls:
        try:
            probe(*args)
        except _Launch as launch:
            logger.debug("tower-sampler-eager: %s launches Triton kernel %s off CUDA", name, launch)
            return None
        except Exception as exc:  # cannot show a launch-free path: keep the patch
            logger.debug("tower-sampler-eager: probing %s off CUDA raised %s: %s", name, type(exc).__name__, exc)
            return None
    return f"{name} runs on non-CUDA (meta) tensors without launching a Triton kernel"


# -- the replacement ----------------------------------------------------------


def _build(original, kernel):
    import torch  # resolved once here, not on every call of the hot path

    tensor_type = torch.Tensor

    @wrap(original)
    def dispatch(*args, **kwargs):
        for value in (*args, *kwargs.values()):
            if isinstance(value, tensor_type):
                if value.is_cuda:
                    return original(*args, **kwargs)
                break
        return kernel(*args, **kwargs)

    dispatch.__drama3_eager_kernel__ = f"{kernel.__module__}:{kernel.__qualname__}"
    return dispatch


def plan(ctx: PatchContext) -> dict:
    out = {}
    for target in ctx.targets:
        original = ctx.original(target)
        if not callable(original):
            raise TypeError(f"{target} is not a function ({type(original).__name__})")
        kernel = kernel_for(target, original)
        reason = upstream_dispatch(kernel.__name__, original)
        if reason is not None:
            ctx.leave(target, f"upstream fix detected: {reason}")
            continue
        out[target] = _build(original, kernel)
        logger.debug("tower-sampler-eager: %s -> %s off CUDA", target, out[target].__drama3_eager_kernel__)
    return out
