"""ray-actor-env: vLLM's Ray actors start with the driver's ``DRAMA3_*`` variables.

Record: ``patches_manifest.yaml``, id ``ray-actor-env`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: ``carried`` picks the variables (prefix ``DRAMA3_``, minus vLLM's non-carry-over list
and the caller's exclusions); ``build_runtime_env`` adds them to the actor's ``runtime_env``
(what Ray sets before the actor's interpreter starts, so the ``.pth`` line sees them);
``build_names`` adds their names to vLLM's copy list (Ray data parallel's engine-core
``runtime_env``, the V1 executor's after-start copy where vLLM still has it: 0.32; 0.33 removed
it). Feature detection: ``needs_*``, ``v1_ray_executor_present``.

The operator's runtime_env wins: a name it sets is never carried. That is a name in the
``runtime_env`` handed in (V2 starts from a copy of ``parallel_config.ray_runtime_env``) or in
the job's ``runtime_env`` (``ray.init(runtime_env=...)``, which vLLM also takes as
``parallel_config.ray_runtime_env``). The second matters under the V1 executor: its actors get a
``runtime_env`` of their own, which Ray merges over the job's name by name, the actor's value
winning, and its after-start copy sets the driver's values in the workers.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

from drama3_patches.logger import init_logger
from drama3_patches.patchlib import PatchContext, function_wrapper

logger = init_logger(__name__)

PREFIX = "DRAMA3_"
RUNTIME_ENV = "vllm.v1.executor.ray_env_utils:update_runtime_env_for_worker_import"
COPY_LIST = "vllm.ray.ray_env:get_env_vars_to_copy"
# The V1 Ray executor (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0), whose after-start copy reads the copy
# list; vLLM 0.33 removed it, leaving Ray data parallel's engine cores the list's only reader.
V1_RAY_EXECUTOR = "vllm.v1.executor.ray_executor"


def v1_ray_executor_present() -> bool:
    """Whether this vLLM still has the V1 Ray executor (found by its module, not by version)."""
    import importlib.util

    if V1_RAY_EXECUTOR in sys.modules:
        return True
    try:
        return importlib.util.find_spec(V1_RAY_EXECUTOR) is not None
    except (ImportError, ValueError):
        return False


def non_carry_over() -> set:
    """vLLM's ``ray_non_carry_over_env_vars.json`` set, as its module read it (empty when vLLM's
    Ray module is not loaded: then nothing of vLLM reads the file either)."""
    module = sys.modules.get("vllm.ray.ray_env")
    names = getattr(module, "RAY_NON_CARRY_OVER_ENV_VARS", None)
    return set(names) if isinstance(names, (set, frozenset, list, tuple)) else set()


def carried(environ: Mapping[str, str], exclude=()) -> dict:
    """The ``DRAMA3_*`` variables of ``environ`` that go to the actors."""
    skip = set(exclude) | non_carry_over()
    return {k: v for k, v in environ.items() if k.startswith(PREFIX) and k not in skip}


def operator_names() -> set:
    """Names the job's ``runtime_env`` sets (the driver's ``ray.init(runtime_env=...)``); empty
    when this process has no Ray job. Ray gives them to every actor of the job unless the actor's
    own ``runtime_env`` names them too."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return set()
    try:
        job = ray.get_runtime_context().runtime_env
        env_vars = (job.to_dict() if hasattr(job, "to_dict") else dict(job or {})).get("env_vars") or {}
    except Exception as exc:  # an older or newer Ray: carry as before, and say so
        logger.warning("ray-actor-env: cannot read the job's runtime_env (%s: %s); the driver's DRAMA3_* "
                       "values go to the actors even where it sets them", type(exc).__name__, exc)
        return set()
    return set(env_vars)


def build_runtime_env(original):
    def update_runtime_env(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        runtime_env = args[0] if args else kwargs.get("runtime_env")
        extra = carried(os.environ, operator_names())
        if extra and hasattr(runtime_env, "setdefault"):
            env_vars = runtime_env.setdefault("env_vars", {})
            for name, value in extra.items():
                # A value the operator put in the runtime_env (parallel_config.ray_runtime_env) stays.
                env_vars.setdefault(name, value)
        return result

    return function_wrapper(original, update_runtime_env)


def build_names(original):
    def env_vars_to_copy(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        exclude = kwargs.get("exclude_vars", args[0] if args else None) or ()
        names = carried(os.environ, set(exclude) | operator_names())
        return result | set(names) if isinstance(result, set) else result

    return function_wrapper(original, env_vars_to_copy)


def needs_runtime_env(original) -> bool:
    """Run the original on an empty runtime_env: needed unless it already hands over a ``DRAMA3_*``
    variable this process has. With none set there is nothing to observe: assumed needed."""
    have = carried(os.environ)
    if not have:
        return True
    out = original({})
    env_vars = (out or {}).get("env_vars", {}) if isinstance(out, dict) else {}
    return not any(name in env_vars for name in have)


def needs_names() -> bool:
    """Needed unless vLLM's own prefixes or names already cover ``DRAMA3_PATCHES``."""
    module = sys.modules.get("vllm.ray.ray_env")
    prefixes = getattr(module, "DEFAULT_ENV_VAR_PREFIXES", set())
    names = getattr(module, "DEFAULT_EXTRA_ENV_VARS", set())
    return not (any(PREFIX.startswith(p) for p in prefixes) or "DRAMA3_PATCHES" in names)


def plan(ctx: PatchContext) -> dict:
    out = {}
    for target, original in ctx.callables():
        if target == RUNTIME_ENV:
            try:
                needed = needs_runtime_env(original)
            except Exception as exc:
                raise RuntimeError(f"{target}: cannot check what it hands the actors: "
                                   f"{type(exc).__name__}: {exc}") from exc
            if not needed:  # the other target is judged on its own
                ctx.leave(target, "it already hands the actors the DRAMA3_* variables")
                continue
            out[target] = build_runtime_env(original)
        elif target == COPY_LIST:
            if not needs_names():
                ctx.leave(target, "vLLM's default prefixes already copy DRAMA3_*")
                continue
            out[target] = build_names(original)
            if not v1_ray_executor_present():
                ctx.note(target, f"V1 route not needed: no V1 Ray executor ({V1_RAY_EXECUTOR}; removed in "
                                 "vLLM 0.33): the copy list serves Ray data-parallel engine cores only")
        else:
            ctx.leave(target, "not a target this patch knows")
    return out
