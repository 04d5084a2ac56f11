"""fish-omni-tp-frames-check: with DRAMA3_PATCHES_TP_CHECK=1 the ranks compare each step's frames.

Record: ``patches_manifest.yaml``, id ``fish-omni-tp-frames-check`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

``build`` wraps ``FishOmniModelState.postprocess_model_output``: in a tensor-parallel group of
more than one rank, :func:`check_frames_agree` after each step. The model state's module alone
is touched: nothing here imports the model module. The digest is in
``drama3_patches.kernels.tensor_parallel``.
"""

from __future__ import annotations

import inspect

import torch

from drama3_patches import env
from drama3_patches.engine import state
from drama3_patches.patchlib import PatchContext, function_wrapper
from drama3_patches.patches.fish_omni_tensor_parallel import tp_group

TARGET = "vllm_omni.model_executor.models.fish_omni.model_state:FishOmniModelState.postprocess_model_output"
STEP_ATTR = "_drama3_tp_check_step"
COUNTER = "tp_steps_checked"  # the steps compared in this process, in the status dict and report


class TensorParallelDrift(RuntimeError):
    """The ranks of one tensor-parallel group sampled different frames."""


def check_frames_agree(frames: torch.Tensor, step: int, group) -> None:
    """Compare a digest of this step's sampled frames across the group; raise naming the step
    and the ranks that differ from the first rank."""
    import torch.distributed as dist

    from drama3_patches.kernels.tensor_parallel import frames_digest

    digest = frames_digest(frames).to("cpu")
    if env.fault("tp-drift") and group.rank_in_group == group.world_size - 1:
        digest = digest + 1  # test-only: this rank's frames differ from rank 0's
    gathered = [torch.empty_like(digest) for _ in range(group.world_size)]
    dist.all_gather(gathered, digest, group=group.cpu_group)
    state.count(COUNTER)
    differ = [rank for rank, other in enumerate(gathered) if not torch.equal(other, gathered[0])]
    if differ:
        digests = ", ".join(f"rank {r}: {tuple(int(x) for x in d)}" for r, d in enumerate(gathered))
        raise TensorParallelDrift(
            f"step {step}: the sampled frames of tensor-parallel rank(s) {differ} differ from rank 0's "
            f"({digests}; {env.TP_CHECK}=1). The ranks would now feed different frames back into the "
            "model: stop the deployment and report it with this line; unset the variable to run unchecked")


def build(original):
    signature = inspect.signature(original)

    def postprocess_model_output(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if not env.tp_check():
            return result
        group = tp_group()
        if group is None:
            return result
        step = instance.__dict__.get(STEP_ATTR, 0)
        instance.__dict__[STEP_ATTR] = step + 1
        batch = signature.bind(instance, *args, **kwargs).arguments["input_batch"]
        check_frames_agree(instance.buffers.sampled_frames[:batch.num_reqs], step, group)
        return result

    return function_wrapper(original, postprocess_model_output)


def plan(ctx: PatchContext) -> dict:
    # No feature detection: the check is inert unless a group of several ranks exists and
    # DRAMA3_PATCHES_TP_CHECK=1, and no upstream version compares the ranks' frames.
    return {TARGET: build(ctx.original(TARGET))}
