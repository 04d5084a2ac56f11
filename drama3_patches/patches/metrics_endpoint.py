"""metrics-endpoint: the patches' states and counters on vLLM's own ``/metrics``.

Record: ``patches_manifest.yaml``, id ``metrics-endpoint`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: ``build`` wraps vLLM's ``attach_router`` (a wrapt ``FunctionWrapper``): the original
mounts ``/metrics``, then ``drama3_patches.metrics.register`` adds the collector to
prometheus_client's ``REGISTRY`` once per process. Only the process that builds the HTTP app
calls it, and prometheus_client is already imported there (by the module this patch targets),
so nothing of the collector loads anywhere else. Where ``PROMETHEUS_MULTIPROC_DIR`` is set
(vLLM's choice for more than one API server) vLLM's page reads only its multiprocess
collector: the target is reported ``skipped`` with that reason and one warning, and nothing is
registered.
"""

from __future__ import annotations

import os

from drama3_patches.logger import init_logger, warning_once
from drama3_patches.patchlib import PatchContext, function_wrapper

logger = init_logger(__name__)

TARGET = "vllm.entrypoints.serve.instrumentator.metrics:attach_router"
MULTIPROC = "PROMETHEUS_MULTIPROC_DIR"
MULTIPROC_REASON = (f"{MULTIPROC} is set (vLLM does so for more than one API server): vLLM's /metrics then "
                    "reads only its multiprocess collector, so the patches' series are not exported; "
                    "read the process reports with `drama3-patches status --collect DIR` instead")

def multiprocess_mode() -> bool:
    """vLLM's own test in ``vllm/v1/metrics/prometheus.py:get_prometheus_registry``."""
    return os.getenv(MULTIPROC) is not None


def warn_multiprocess() -> None:
    """One warning per process, whether the plan or a call found the variable."""
    warning_once(logger, MULTIPROC, "drama3-patches: metrics-endpoint: %s", MULTIPROC_REASON)


def build(original):
    def attach_router(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if multiprocess_mode():  # set after this module was imported: the same decision, at the call
            warn_multiprocess()
            return result
        try:
            from drama3_patches import metrics

            metrics.register()
        except Exception as exc:  # vLLM's page stays as vLLM made it
            logger.warning("drama3-patches: metrics-endpoint: cannot register the /metrics collector "
                           "(%s: %s); /metrics shows vLLM's series only", type(exc).__name__, exc)
        return result

    return function_wrapper(original, attach_router)


def plan(ctx: PatchContext) -> dict:
    out = {}
    for target, original in ctx.callables():
        if multiprocess_mode():
            warn_multiprocess()
            ctx.skip(target, MULTIPROC_REASON)
            continue
        out[target] = build(original)
    return out
