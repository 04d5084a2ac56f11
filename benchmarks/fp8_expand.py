"""Block-FP8 -> bfloat16 expansion of one MoE layer: naive vs ours vs clone().

Each method runs in its own fresh process, so that its peak resident memory is
its own: the child builds the inputs and the (zeroed) output, warms the method up on a
tiny layer, resets the kernel's peak-RSS counter (``/proc/self/clear_refs``),
runs the method, and reports the time and the peak RSS above that point: the
memory the method needs beyond its inputs and output.  Methods:

  naive      per expert: ``(w.float() * scale_expanded).to(bfloat16)``,
             stacked in the checkpoint layout (E, N, K)
  naive_t    the same, then copied transposed into (E, K, N): the layout the
             Ascend bf16 MoE method keeps (what the port's device transpose made)
  ours       drama3_patches.kernels.fp8.dequant_experts, transposed layout
  ours_n     the same in the checkpoint layout
  ours_pool  ours with num_threads = torch's thread count: row chunks on Python
             threads, torch ops single-threaded (for hosts whose cores are busy)
  clone      out.copy_(bf16 tensor of output size): the memory-bandwidth yardstick

Every expansion result is compared bit for bit with ``naive`` (one expert
each of w13 and w2, checked in the child).  Run::

    python benchmarks/fp8_expand.py                       # 64 experts, 1536x2048 + 2048x768
    python benchmarks/fp8_expand.py --experts 16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
METHODS = ("naive", "naive_t", "ours", "ours_n", "ours_pool", "clone")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _trim_heap() -> None:
    # Free heap pages left resident by the setup would otherwise hide in the baseline.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _child(method: str, experts: int, shapes: list[tuple[int, int]], repeats: int, threads: int) -> dict:
    import torch

    from drama3_patches.kernels.fp8 import dequant_experts, reference_dequant

    if threads:
        torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1234)

    def make(experts: int, shapes: list[tuple[int, int]]):
        layers = []
        for n, k in shapes:
            # Finite codes only (0x7F/0xFF are NaN): the bit check below is then a plain equality.
            codes = torch.randint(0, 255, (experts, n, k), dtype=torch.uint8, generator=gen)
            codes[(codes & 0x7F) == 0x7F] = 0x7E
            w = [codes[e].clone().view(torch.float8_e4m3fn) for e in range(experts)]
            del codes
            s = [torch.rand((n + 127) // 128, (k + 127) // 128, generator=gen) * 1e-2 for _ in range(experts)]
            layers.append((w, s))
        # Outputs exist (and are paged in) before the clock and the peak counter start:
        # the parameter a loader fills is allocated up front, so "peak+" is pure scratch.
        transposed = method in ("naive_t", "ours", "ours_pool")
        outs = [torch.zeros((experts, k, n) if transposed else (experts, n, k), dtype=torch.bfloat16)
                for n, k in shapes]
        yard = [torch.ones(experts, n, k, dtype=torch.bfloat16) if method == "clone" else None for n, k in shapes]
        return layers, yard, outs

    def run(layers, yard, outs, experts):
        for (w, s), y, out in zip(layers, yard, outs):
            if method == "clone":
                out.copy_(y)  # the same bytes written, read from bf16: the bandwidth yardstick
            elif method in ("naive", "naive_t"):
                for e in range(experts):
                    dense = reference_dequant(w[e], s[e])
                    out[e].copy_(dense.t() if method == "naive_t" else dense)
                    del dense
            else:
                # Hand over fresh containers; the master lists keep the inputs for the next repeat.
                dequant_experts(list(w), list(s), out, transposed=method != "ours_n",
                                num_threads=torch.get_num_threads() if method == "ours_pool" else None)
        return outs

    # Page in the code this method runs (libtorch kernels, threads) on a tiny layer first:
    # that RSS is not the method's data.
    small = make(2, [(256, 384), (384, 256)])
    run(*small, 2)
    del small
    layers, yard, outs = make(experts, shapes)
    out_bytes = sum(experts * n * k * 2 for n, k in shapes)

    _trim_heap()
    base_kib = _rss_kib("VmRSS")
    peak_ok = _reset_peak()
    t0 = time.perf_counter()
    run(layers, yard, outs, experts)
    times = [time.perf_counter() - t0]
    peak_kib = _rss_kib("VmHWM")
    checked = None
    if method != "clone":
        checked = True
        for (w, s), out in zip(layers, outs):
            for e in (0, experts - 1):
                ref = reference_dequant(w[e], s[e])
                got = out[e].t() if method in ("naive_t", "ours", "ours_pool") else out[e]
                checked &= torch.equal(got.contiguous().view(torch.int16), ref.view(torch.int16))
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        run(layers, yard, outs, experts)
        times.append(time.perf_counter() - t0)
    return {
        "method": method,
        "times": times,
        "peak_extra_bytes": (peak_kib - base_kib) * 1024 if peak_ok else None,
        "out_bytes": out_bytes,
        "bit_identical_to_naive": checked,
        "threads": torch.get_num_threads(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--shapes", default="1536x2048,2048x768", help="per-expert N x K of each weight (w13, w2)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs in each process")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per method, interleaved (median time, max peak)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: torch default)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="print raw results as JSON too")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.child:
        print(json.dumps(_child(args.child, args.experts, shapes, args.repeats, args.threads)))
        return 0

    results: dict[str, dict] = {}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p)
    # Rounds of one fresh process per method, interleaved, so that load from
    # other processes on the host hits every method alike.
    for _ in range(args.rounds):
        for method in args.methods.split(","):
            cmd = [sys.executable, __file__, "--child", method, "--experts", str(args.experts), "--shapes",
                   args.shapes, "--repeats", str(args.repeats), "--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(proc.stdout, proc.stderr, file=sys.stderr)
                return 1
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            if method not in results:
                results[method] = res
            else:
                agg = results[method]
                agg["times"] += res["times"]
                if res["peak_extra_bytes"] is not None and agg["peak_extra_bytes"] is not None:
                    agg["peak_extra_bytes"] = max(agg["peak_extra_bytes"], res["peak_extra_bytes"])
                agg["bit_identical_to_naive"] = agg["bit_identical_to_naive"] and res["bit_identical_to_naive"]

    expert_bf16 = max(n * k for n, k in shapes) * 2
    mib = 1 << 20
    some = next(iter(results.values()))
    print(f"{args.experts} experts of {args.shapes} (N x K), output {some['out_bytes'] / mib:.0f} MiB bf16, "
          f"one expert bf16 = {expert_bf16 / mib:.2f} MiB, torch threads {some['threads']}, "
          f"{args.rounds} processes x {args.repeats} runs each: median time, max peak")
    print(f"{'method':8s} {'time s':>8s} {'vs naive':>9s} {'vs naive_t':>10s} {'vs clone':>9s} "
          f"{'peak+ MiB':>10s} {'/ expert':>10s} {'bits ok':>8s}")
    med = {m: statistics.median(r["times"]) for m, r in results.items()}
    for m, r in results.items():
        extra = r["peak_extra_bytes"]
        cols = [
            f"{m:8s}",
            f"{med[m]:8.3f}",
            f"{med['naive'] / med[m]:8.2f}x" if "naive" in med else f"{'-':>9s}",
            f"{med['naive_t'] / med[m]:9.2f}x" if "naive_t" in med else f"{'-':>10s}",
            f"{med['clone'] / med[m]:8.2f}x" if "clone" in med else f"{'-':>9s}",
            f"{extra / mib:10.1f}" if extra is not None else f"{'n/a':>10s}",
            f"{extra / expert_bf16:10.2f}" if extra is not None else f"{'n/a':>10s}",
            f"{str(r['bit_identical_to_naive']):>8s}",
        ]
        print(" ".join(cols))
    print("vs X = X's time / this time (higher is faster); peak+ = peak RSS during the run above inputs and "
          "the preallocated output (memory beyond the output); / expert = peak+ in units of one expert's bf16 size")
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
