"""fish-omni-tensor-parallel: Drama 3's stage 0 runs over a tensor-parallel group, ranks kept in step.

Record: ``patches_manifest.yaml``, id ``fish-omni-tensor-parallel`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: ``build_init`` (the model constructor seen with one reported tensor rank; pipeline
parallel goes to the original untouched), ``build_codes`` (the request's reference codes taken
from the group's first rank: :func:`broadcast_codes`). ``refuses_tp`` is the feature detection,
run on a throwaway instance with a config that stops it past the check. Both targets sit in the
model module, so one ``plan`` run sees them together. The frames check is its own patch
(``fish_omni_tp_frames_check``).
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from drama3_patches.logger import init_logger
from drama3_patches.patchlib import NotNeeded, PatchContext, function_wrapper

logger = init_logger(__name__)

MODEL_MODULE = "vllm_omni.model_executor.models.fish_omni.fish_omni_model"
MODEL_CLASS = "FishOmniForConditionalGeneration"
INIT = f"{MODEL_MODULE}:{MODEL_CLASS}.__init__"
CODES = f"{MODEL_MODULE}:{MODEL_CLASS}._reference_codes"
# The codes of one reference: [frames, codebooks], a few thousand frames at most.
_MAX_CODE_ELEMENTS = 1 << 26
_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def tp_group():
    """vLLM's tensor-parallel group coordinator when it has more than one rank, else None."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tp_group()
    return group if group.world_size > 1 else None


# ----------------------------------------------------------------------------------------------
# The constructor
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _one_reported_rank(parallel_config):
    # Only the published check reads the configured size during construction: every layer
    # takes its size from the process group, and the hybrid-state shapes are read later.
    size = parallel_config.tensor_parallel_size
    parallel_config.tensor_parallel_size = 1
    try:
        yield
    finally:
        parallel_config.tensor_parallel_size = size


def build_init(original):
    def init(wrapped, instance, args, kwargs):
        vllm_config = kwargs.get("vllm_config")
        if vllm_config is None:
            from vllm.config import get_current_vllm_config

            vllm_config = get_current_vllm_config()
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size == 1 or parallel.pipeline_parallel_size != 1:
            return wrapped(*args, **kwargs)  # nothing to lift, or pipeline parallel: upstream's refusal
        with _one_reported_rank(parallel):
            result = wrapped(*args, **kwargs)
        logger.info("fish-omni-tensor-parallel: built %s at tensor_parallel_size=%d (expert parallel %s)",
                    type(instance).__name__, parallel.tensor_parallel_size,
                    "on" if parallel.enable_expert_parallel else "off")
        return result

    return function_wrapper(original, init)


class _Past(Exception):
    """The probed constructor read something after its parallel check."""


class _Stopper:
    """Known attributes as given; any other read raises :class:`_Past` naming ``where.name``."""

    def __init__(self, where: str = "config", **known):
        self.__dict__.update(known)
        self.__dict__["_where"] = where

    def __getattr__(self, name):
        raise _Past(f"{self._where}.{name}")


# The first read after the published check: the model path. Any other unknown read means the
# constructor changed shape, and only the expected stop may count as "past the check".
EXPECTED_STOP = "model_config.model"


def probe_config(tensor_parallel_size=2, pipeline_parallel_size=1, enable_expert_parallel=False):
    parallel = _Stopper("parallel_config", tensor_parallel_size=tensor_parallel_size,
                        pipeline_parallel_size=pipeline_parallel_size, enable_expert_parallel=enable_expert_parallel)
    model = _Stopper("model_config", hf_config=_Stopper("hf_config"))
    return _Stopper("vllm_config", parallel_config=parallel, model_config=model)


def refuses_tp(original) -> bool:
    """Run the constructor on a throwaway instance with tensor_parallel_size=2.

    True when it raises NotImplementedError (the published refusal), False when it stops at
    :data:`EXPECTED_STOP` (it went past the check). Anything else, another unknown read
    included, raises LookupError: the constructor no longer looks like the one this patch lifts.
    """
    owner = importlib.import_module(MODEL_MODULE).__dict__[MODEL_CLASS]
    probe = object.__new__(owner)
    try:
        original(probe, vllm_config=probe_config(), prefix="")
    except NotImplementedError:
        return True
    except _Past as exc:
        if str(exc) == EXPECTED_STOP:
            return False
        raise LookupError(f"the constructor read {exc} where the probe expected {EXPECTED_STOP}") from None
    raise LookupError("the constructor returned from a probe config it could not have used")


# ----------------------------------------------------------------------------------------------
# Rank agreement
# ----------------------------------------------------------------------------------------------


def broadcast_codes(codes, group):
    """Every rank returns the first rank's ``codes`` (a CPU integer tensor or None).

    Two broadcasts on the group's CPU (gloo) group: a fixed header (state, dtype, ndim,
    shape), then the data. A rank whose own codes differ says so in the log. Codes the first
    rank cannot send make every rank raise the same error, so no rank waits for data.
    """
    import torch.distributed as dist

    src, first = group.ranks[0], group.rank_in_group == 0
    header = torch.zeros(6, dtype=torch.int64)  # state (0 none, 1 codes, 2 unsendable), dtype, ndim, shape
    if first and codes is not None:
        # Checked before the header goes out: an error here would leave the other ranks waiting.
        if (not isinstance(codes, torch.Tensor) or codes.dim() > 3 or codes.dtype not in _DTYPES
                or codes.numel() > _MAX_CODE_ELEMENTS):
            header[0] = 2
        else:
            header[:3] = torch.tensor([1, _DTYPES.index(codes.dtype), codes.dim()])
            header[3:3 + codes.dim()] = torch.tensor(codes.shape, dtype=torch.int64)
    dist.broadcast(header, src=src, group=group.cpu_group)
    state = int(header[0])
    if state == 2:
        raise ValueError("tensor-parallel rank 0's reference codes are not a tensor of at most 3 dimensions "
                         f"and {_MAX_CODE_ELEMENTS} integers of {[str(d) for d in _DTYPES]}")
    if state == 0:
        if codes is not None:
            logger.warning("fish-omni-tensor-parallel: rank %d had reference codes where rank 0 had none; "
                           "using none", group.rank_in_group)
        return None
    dtype, ndim = _DTYPES[int(header[1])], int(header[2])
    shape = [int(d) for d in header[3:3 + ndim]]
    data = codes.detach().to("cpu").contiguous() if first else torch.empty(shape, dtype=dtype)
    dist.broadcast(data, src=src, group=group.cpu_group)
    if not first and not (isinstance(codes, torch.Tensor) and codes.shape == data.shape
                          and torch.equal(codes.to("cpu", dtype), data)):
        logger.warning("fish-omni-tensor-parallel: rank %d's reference codes differ from rank 0's "
                       "(a nondeterministic encoder); using rank 0's", group.rank_in_group)
    return data


def build_codes(original):
    def reference_codes(wrapped, instance, args, kwargs):
        codes = wrapped(*args, **kwargs)
        group = tp_group()
        return codes if group is None else broadcast_codes(codes, group)

    return function_wrapper(original, reference_codes)


# ----------------------------------------------------------------------------------------------
# Plan
# ----------------------------------------------------------------------------------------------


BUILDERS = {INIT: build_init, CODES: build_codes}


def plan(ctx: PatchContext) -> dict:
    try:
        needed = refuses_tp(ctx.original(INIT))
    except Exception as exc:
        raise RuntimeError(f"{INIT}: cannot check whether it refuses tensor_parallel_size=2: "
                           f"{type(exc).__name__}: {exc}") from exc
    if not needed:
        raise NotNeeded(f"{INIT} already accepts tensor_parallel_size=2 (probe)")
    return {target: BUILDERS[target](ctx.original(target)) for target in ctx.targets}
