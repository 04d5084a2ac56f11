"""lora-count-forwarding: the NPU Omni V2 AR runner hands ``num_active_loras`` on when it can.

Record: ``patches_manifest.yaml``, id ``lora-count-forwarding`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: ``parent_method`` finds the next ``prepare_inputs`` in the MRO; ``_signatures`` reads it
once, when ``plan`` runs (at import of the runner module), and ``build`` returns a wrapper whose
published signature is the caller's (``wrap(signature=...)``), so the next feature detection
sees what it accepts.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict

from drama3_patches.logger import init_logger
from drama3_patches.patchlib import PatchContext, overridden, wrap

logger = init_logger(__name__)

ARG = "num_active_loras"
_ABSENT = inspect.Parameter.empty


def parent_method(cls: type, name: str):
    parent = overridden(cls, name)
    if parent is None:
        raise AttributeError(f"no class after {cls.__qualname__} in its MRO defines {name}")
    return parent


def _signatures(parent) -> tuple[inspect.Signature, inspect.Signature, bool, bool]:
    """(signature the caller may use, the parent's, parent names ARG, parent requires ARG)."""
    psig = inspect.signature(parent)
    p = psig.parameters.get(ARG)
    forwards = p is not None and p.kind is not inspect.Parameter.POSITIONAL_ONLY
    required = forwards and p.default is _ABSENT
    params = list(psig.parameters.values())
    optional = inspect.Parameter(ARG, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
    if p is not None:
        params[params.index(p)] = optional.replace(kind=p.kind)
    else:
        # Where vLLM's MR V2 passes it: right after the parent's last positional parameter.
        at = sum(
            1 for q in params
            if q.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        )
        params.insert(at, optional)
    return psig.replace(parameters=params), psig, forwards, required


def build(original, parent):
    caller_sig, parent_sig, forwards, required = _signatures(parent)

    @wrap(original, signature=caller_sig)
    def prepare_inputs(*args, **kwargs):
        bound = caller_sig.bind(*args, **kwargs)
        given = bound.arguments.pop(ARG, None)
        arguments = OrderedDict(bound.arguments)
        if forwards:
            if given is None and required:
                batch_desc = arguments.get("batch_desc")
                given = getattr(batch_desc, ARG, None)
                if given is None:
                    raise TypeError(
                        f"{parent.__qualname__} requires {ARG} and neither the caller nor the "
                        "batch descriptor gave it"
                    )
            if given is not None:
                arguments[ARG] = given
        call = inspect.BoundArguments(parent_sig, arguments)
        return original(*call.args, **call.kwargs)

    prepare_inputs.forwards_num_active_loras = forwards
    return prepare_inputs


def plan(ctx: PatchContext) -> dict:
    out = {}
    for target in ctx.targets:
        cls, name = ctx.owner(target)
        parent = parent_method(cls, name)
        out[target] = build(ctx.original(target), parent)
        ctx.logger.info(
            "drama3-patches: %s.%s %s %s to %s.%s", cls.__qualname__, name,
            "forwards" if out[target].forwards_num_active_loras else "drops", ARG,
            parent.__module__, parent.__qualname__,
        )
    return out
