"""Target audit: where every manifest target resolves in this session's installed code.

One fresh interpreter per audit (patches off, so the lines point at upstream code) imports each target
module and reads the target's raw definition. The table it prints (run with ``-s``, or set
``DRAMA3_AUDIT_OUT=FILE``) is the one the closing notes quote. The test fails when

* a target of a patch whose version guards pass here does not resolve (drift), or
* a target claimed stand-in-only imports here after all (the claim is stale), or has no
  stand-in under ``tests/replicas/``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.replicas import ASCEND_MAIN, PIL_QWEN2VL_ENV, PIL_QWEN2VL_PATH, enter_npu_workers, profile_paths
from support.subproc import ROOT, call


# Module prefix -> why the module cannot import on a CPU host beside vLLM 0.31/0.32. The audit
# imports these a second time beside the vLLM-Ascend stand-in (and vLLM-Omni's NPU runner
# stand-ins) to show where each target then resolves: in published code, ours, or a stand-in.
STAND_IN_ONLY = {
    "vllm_omni.platforms.npu.worker": "vLLM-Omni's NPU workers import vLLM-Ascend's NPU worker",
    "vllm_ascend": "vLLM-Ascend has no release for vLLM 0.31/0.32 on the package index and needs torch_npu",
    "drama3_patches.patches._npu_omni_ar_runner":
        "the project's NPU Omni V2 AR runner subclasses vLLM-Ascend's V2 NPUModelRunner",
}

def _raw_definition(owner, name):
    # The raw class-dict entry along the MRO (a classmethod stays one), else getattr.
    for klass in getattr(owner, "__mro__", ()):
        if name in vars(klass):
            return vars(klass)[name]
    return getattr(owner, name)


def _source(obj):
    import inspect

    for attr in ("fget", "__func__"):
        obj = getattr(obj, attr, obj)
    obj = inspect.unwrap(obj)
    try:
        return inspect.getsourcefile(obj), inspect.getsourcelines(obj)[1], obj.__qualname__, obj.__module__
    except (OSError, TypeError, AttributeError):
        return None, None, None, None


def audit_rows(beside_stand_ins: bool) -> list[dict]:
    """A child's audit: import each target module, read the target's raw definition."""
    import importlib

    from drama3_patches.manifest import load_manifest
    from drama3_patches.versions import check

    if beside_stand_ins:
        enter_npu_workers()
    rows = []
    for patch in load_manifest().patches:
        guards = [check(d, s) for d, s in patch.requires.items()]
        in_range = all(ok for ok, _ in guards)
        for target in patch.targets:
            row = {"patch": patch.id, "target": target.spec, "in_range": in_range,
                   "guards": "; ".join(why for ok, why in guards if not ok)}
            try:
                owner = importlib.import_module(target.module)
                *path, name = target.attr_path
                for part in path:
                    owner = getattr(owner, part)
                obj = _raw_definition(owner, name)
            except BaseException as exc:
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
                rows.append(row)
                continue
            row["file"], row["line"], row["qualname"], row["defined_in"] = _source(obj)
            rows.append(row)
    return rows


def _audit(beside_stand_ins: bool = False) -> list[dict]:
    # A fresh interpreter per audit: the two see different module states (without and beside
    # the stand-ins), and nothing in them has been patched.
    paths = profile_paths(ASCEND_MAIN) if beside_stand_ins else []
    # PIL_QWEN2VL: fish_omni_model's targets resolve without torchvision (support.replicas).
    return call(audit_rows, beside_stand_ins, pythonpath=[*paths, *PIL_QWEN2VL_PATH], env=PIL_QWEN2VL_ENV,
                timeout=600)


def _stand_in_reason(target_module: str) -> str | None:
    for prefix, why in STAND_IN_ONLY.items():
        if target_module == prefix or target_module.startswith(prefix + "."):
            return why
    return None


def _where(row: dict) -> str:
    """``module:line`` of the definition, saying whose code it is."""
    file = row.get("file") or ""
    module = row["target"].split(":")[0]
    if "replicas" in Path(file).parts:
        return f"stand-in {Path(file).relative_to(ROOT / 'tests' / 'replicas')}:{row['line']}"
    kind = "project" if Path(file).is_relative_to(ROOT / "drama3_patches") else "published"
    if row.get("qualname") and row["qualname"] not in row["target"]:
        # Inherited: say where the definition the patch wraps really lives.
        return f"{kind} {row['defined_in']}:{row['line']} ({row['qualname']}, inherited)"
    return f"{kind} {module}:{row['line']}"


def _table(rows) -> str:
    lines = ["| patch | target | guards here | resolved at |", "| --- | --- | --- | --- |"]
    for r in rows:
        guards = "pass" if r["in_range"] else r["guards"]
        lines.append(f"| {r['patch']} | `{r['target']}` | {guards} | {r['audit']} |")
    return "\n".join(lines)


@pytest.mark.vllm
def test_every_manifest_target_resolves_or_is_a_declared_stand_in():
    plain = _audit()
    beside = {r["target"]: r for r in _audit(beside_stand_ins=True)}
    problems = []
    for r in plain:
        why = _stand_in_reason(r["target"].split(":")[0])
        if "error" not in r:
            r["audit"] = _where(r)
            if why:
                problems.append(f"{r['target']} imports here: its stand-in-only claim is stale")
            continue
        if not why:
            if r["in_range"]:
                problems.append(f"{r['target']} ({r['patch']}, in range here) does not resolve: {r['error']}")
            # Out of this session's range (e.g. fish_omni beside vLLM-Omni 0.31.0rc1): nothing to apply.
            r["audit"] = f"not in this session's code ({r['error']})"
            continue
        second = beside[r["target"]]
        if "error" in second:
            problems.append(f"{r['target']} resolves neither here nor beside the stand-ins: {second['error']}")
            r["audit"] = f"unresolved: {r['error']}"
            continue
        r["audit"] = f"{_where(second)}, beside the vLLM-Ascend stand-in ({why}; here: {r['error']})"
    table = _table(plain)
    out = os.environ.get("DRAMA3_AUDIT_OUT")
    if out:
        Path(out).write_text(table + "\n")
    print(table)
    assert not problems, "\n".join(problems)
    # The audit really looked: every target in range here resolved to a source line somewhere.
    assert all(r["audit"].split(",")[0].rsplit(":", 1)[-1].split(" ")[0].isdigit()
               for r in plain if r["in_range"] or _stand_in_reason(r["target"].split(":")[0])), table
