"""The deploy file a validation serves: a shipped profile or the operator's file, scaled to the run.

Kept as given: every stage's placement (devices, tensor and expert parallel), runners,
connectors, compilation. Changed for the run, on stage 0 only: the KV pool (a fixed number of
blocks, small enough that a few growing requests preempt one another), the longest request, and
the frames a request makes when it does not say.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from drama3_patches.tools.files import MIB, InputError, read_text

MAX_DEPLOY_BYTES = 4 * MIB


@dataclass(frozen=True)
class Scale:
    kv_blocks: int
    max_model_len: int
    frames: int


def load(profile: str | None, path: str | None) -> tuple[str, dict]:
    """(name, deploy dict) of ``--profile`` or ``--deploy``; InputError naming what is wrong."""
    import yaml

    if path:
        text, name = read_text(path, MAX_DEPLOY_BYTES, "deploy file"), path
    else:
        from drama3_patches.tools.deploy_config.profiles import PROFILES, profile_names, profile_text

        if profile not in PROFILES:
            raise InputError(f"unknown profile {profile!r}; known: {', '.join(profile_names())} "
                             "(or give your own file with --deploy)")
        text, name = profile_text(profile), profile
    try:
        deploy = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InputError(f"{name}: not YAML: {str(exc).splitlines()[0]}") from None
    stages = deploy.get("stages") if isinstance(deploy, dict) else None
    if not isinstance(stages, list) or not all(isinstance(s, dict) for s in stages) or stage0(deploy) is None:
        raise InputError(f"{name}: no stage with stage_id 0 under 'stages'; is this a vLLM-Omni deploy file?")
    return name, deploy


def stage0(deploy: dict) -> dict | None:
    return next((s for s in deploy.get("stages", []) if s.get("stage_id", 0) == 0), None)


def tp_size(deploy: dict) -> int:
    return int(stage0(deploy).get("tensor_parallel_size") or 1)


def compiles(deploy: dict) -> bool:
    """Whether stage 0 runs compiled (graph capture at start-up) rather than eager."""
    return not stage0(deploy).get("enforce_eager", False)


def expert_parallel(deploy: dict) -> bool:
    return bool(stage0(deploy).get("enable_expert_parallel", False))


def scaled(deploy: dict, scale: Scale, profiler: dict | None = None) -> dict:
    """A copy of ``deploy`` with stage 0's KV pool, longest request and default frames set, and
    ``profiler`` as stage 0's ``profiler_config`` when given (``validate.profile``: off until the
    per-frame window asks for it)."""
    out = copy.deepcopy(deploy)
    ar = stage0(out)
    if profiler is not None:
        ar["profiler_config"] = dict(profiler)
    # num_gpu_blocks_override reaches vLLM's engine arguments through vLLM-Omni's engine_extras.
    ar["num_gpu_blocks_override"] = scale.kv_blocks
    ar["max_model_len"] = min(int(ar.get("max_model_len") or scale.max_model_len), scale.max_model_len)
    params = ar.setdefault("default_sampling_params", {})
    params["max_tokens"] = scale.frames
    return out
