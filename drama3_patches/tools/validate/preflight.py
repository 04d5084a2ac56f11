"""Is this host able to run a validation at all? Asked before anything starts.

The first problem found is one line naming it and its fix (``InputError``: exit 2), never a
traceback half-way through making a model. The pairing rules are ``doctor``'s own
(``doctor.check_pairings``), so validate and doctor never disagree about a host.
"""

from __future__ import annotations

import importlib.util
import sys

from drama3_patches.tools.files import InputError

# What making the tiny checkpoint imports (tools/tiny_model.py): the codec's shapes come from vLLM-Omni.
TINY_MODEL_NEEDS = (("torch", "pip install torch (the one your vLLM pins)"),
                    ("numpy", "pip install numpy"),
                    ("tokenizers", "pip install tokenizers (vLLM's transformers brings it)"))


def problems(need_tiny_model: bool, installed=None, find_spec=None, vllm_command=None) -> list[tuple[str, str]]:
    """(what is wrong, its fix) for each problem, in the order they block a run."""
    from packaging.version import InvalidVersion, Version

    from drama3_patches.tools import doctor, pairings
    from drama3_patches.versions import installed_version

    installed = installed or installed_version
    find_spec = find_spec or importlib.util.find_spec
    out = []
    vllm, omni = installed("vllm"), installed("vllm-omni")
    newest = pairings.PAIRINGS[-1]
    if vllm is None:
        out.append((f"vLLM is not installed beside this Python ({sys.executable}); validate serves with "
                    "`vllm serve --omni`", doctor._install("vllm", f"=={newest.vllm}")))
    if omni is None:
        out.append((f"vLLM-Omni is not installed beside this Python ({sys.executable}); Drama 3 is served by "
                    f"its fish_omni (vLLM-Omni {pairings.DRAMA3_OMNI})",
                    doctor._install("vllm-omni", f"=={newest.vllm_omni}")))
    if out:
        return out
    for check in doctor.check_pairings(installed):
        if not check.ok and not check.warning:
            out.append((check.detail, check.fix))
    try:
        has_drama3 = Version(omni) >= Version(pairings.DRAMA3_OMNI)
    except InvalidVersion:
        has_drama3 = True  # the pairing check above already named an unreadable version
    if not has_drama3:
        out.append((f"vLLM-Omni {omni} has no Drama 3 model (fish_omni arrived in {pairings.DRAMA3_OMNI})",
                    doctor._install("vllm-omni", f"=={pairings.DRAMA3_OMNI}")))
    if vllm_command is None:
        from drama3_patches.tools.validate.server import vllm_command
    try:
        vllm_command()
    except InputError as exc:
        out.append((str(exc), "reinstall vLLM in this environment (its `vllm` command comes with it)"))
    if need_tiny_model:
        for module, fix in TINY_MODEL_NEEDS:
            if find_spec(module) is None:
                out.append((f"making the tiny model (no --model given) needs the `{module}` module, which is not "
                            "installed", fix))
    return out


def check(need_tiny_model: bool, **kwargs) -> None:
    """Raise InputError, one line, for the first problem."""
    found = problems(need_tiny_model, **kwargs)
    if found:
        what, fix = found[0]
        raise InputError(f"this host cannot run a validation: {what}; fix: {fix}")
