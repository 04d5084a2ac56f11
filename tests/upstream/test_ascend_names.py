"""Ascend-name audit: every ``vllm_ascend`` name the patches import or read, resolved in each
vLLM-Ascend stand-in profile (public main of 2026-08-22 and 0.30.0rc2, the newest published source).

The names are read off the package's own source (``from vllm_ascend... import``, ``import
vllm_ascend...``, and string constants naming a ``vllm_ascend`` module or ``module:attribute``) and the
manifest's targets, not from a list kept by hand. A fresh interpreter per profile imports each. The
test fails when a name does not resolve in a profile and ``HANDLED`` does not say, for that profile,
how the patch takes its absence by feature. The table it prints (``-s``, or ``DRAMA3_AUDIT_OUT=FILE``)
is the one the closing notes quote.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from support.replicas import ASCEND_030RC2, ASCEND_MAIN, profile_paths
from support.subproc import ROOT, call

PROFILES = (ASCEND_MAIN, ASCEND_030RC2)
_NAME = re.compile(r"^vllm_ascend(\.\w+)+(:[\w.]+)?$")

# name -> (profiles where it is absent, how the patch handles that and what it says).
_CONFIG_ROUTE = ("fp8-expert-method looks AscendFp8Config up in both layouts (CONFIG_MODULES); status names the "
                 "route and each known path that did not import ('not imported: <path>: absent')")
HANDLED = {
    "vllm_ascend.quantization.configs.fp8_config": ((ASCEND_MAIN,), _CONFIG_ROUTE),
    "vllm_ascend.quantization.fp8_config": ((ASCEND_030RC2,), _CONFIG_ROUTE),
    "vllm_ascend.quantization.methods.registry": (
        (ASCEND_MAIN,), "no block-FP8 MoE scheme: fp8-expert-method's route is cpu on a 910B, and status says "
                        "'has no block-FP8 MoE scheme and the card has no MXFP8'"),
    "vllm_ascend.utils:get_ascend_device_type": (
        (ASCEND_MAIN,), "has_mxfp8 reads vllm_ascend.device.device_config first; the utils name is the "
                        "fallback of older releases"),
    "vllm_ascend.utils:maybe_trans_nz": (
        (ASCEND_MAIN,), "main keeps it in ops/fused_moe/routed_experts.py, which _finish_like_base reads next"),
    "vllm_ascend.ascend_config:get_ascend_config": (
        (ASCEND_MAIN,), "left out of the main stand-in (every published vLLM-Ascend has it); without it "
                        "_finish_like_base takes the path without fused MC2"),
}


def patch_names() -> set[str]:
    """``vllm_ascend`` modules and ``module:attribute`` names in drama3_patches and the manifest."""
    names = set()
    for path in sorted((ROOT / "drama3_patches").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm_ascend"):
                names.update(f"{node.module}:{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names if a.name.startswith("vllm_ascend"))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.match(node.value):
                names.add(node.value)
    for line in (ROOT / "patches_manifest.yaml").read_text().splitlines():
        target = line.strip().removeprefix("- ")
        if _NAME.match(target):
            names.add(target)
    return names


def resolve_names(names: list[str]) -> dict[str, str | None]:
    """In the child: each name -> None when it resolves, else the error."""
    import importlib

    out = {}
    for name in names:
        module, _, attr = name.partition(":")
        try:
            obj = importlib.import_module(module)
            for i, part in enumerate(filter(None, attr.split("."))):
                if i == 0 and not hasattr(obj, part):  # `from package import submodule`
                    obj = importlib.import_module(f"{module}.{part}")
                    continue
                obj = getattr(obj, part)
            out[name] = None
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
    return out


def test_the_scan_finds_the_names_the_patches_use():
    names = patch_names()
    # Independent of the scan: names written in three different ways in the package.
    assert "vllm_ascend.worker.v2.model_runner:NPUModelRunner" in names            # from-import and constant
    assert "vllm_ascend.quantization.configs.fp8_config" in names                  # a module in a tuple
    assert ("vllm_ascend.patch.platform.patch_mamba_manager:AscendMambaManager.get_num_blocks_to_allocate"
            in names)                                                              # a manifest target
    assert not [n for n in names if not n.startswith("vllm_ascend")]
    assert set(HANDLED) <= names, sorted(set(HANDLED) - names)  # nothing handled that no patch uses


@pytest.mark.vllm
def test_every_ascend_name_resolves_in_each_profile_or_its_absence_is_handled():
    names = sorted(patch_names())
    results = {p: call(resolve_names, names, pythonpath=profile_paths(p), timeout=600) for p in PROFILES}
    rows, problems = ["| name | " + " | ".join(PROFILES) + " |", "| --- |" + " --- |" * len(PROFILES)], []
    for name in names:
        cells = []
        for p in PROFILES:
            error = results[p][name]
            absent_in, how = HANDLED.get(name, ((), ""))
            if error is None:
                cells.append("resolves")
                if p in absent_in:
                    problems.append(f"{name} resolves in {p}: HANDLED's claim of its absence is stale")
            elif p in absent_in:
                cells.append("handled by feature")
            else:
                cells.append(f"MISSING ({error})")
                problems.append(f"{name} does not resolve in {p} and no patch handles that: {error}")
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    table = "\n".join(rows)
    out = os.environ.get("DRAMA3_AUDIT_OUT")
    if out:
        Path(out).write_text(table + "\n")
    print(table)
    assert not problems, "\n".join(problems)
    # The audit really looked: names resolved in both profiles, and some were found absent.
    assert all(sum(v is None for v in results[p].values()) >= 6 for p in PROFILES), results
    assert any(v is not None for v in results[ASCEND_MAIN].values())
