"""Block-FP8 -> bfloat16 expansion of one MoE weight, side by side, under three host conditions.

Two long-lived worker processes each hold the same inputs (``--experts`` fp8
experts of ``--shape`` N x K with float32 128x128 block scales, finite codes) and
a preallocated, paged-in output.  Every round runs each method in each condition,
in an order rotated per round, so that load from other processes on the host hits
every method alike; the table shows medians over rounds, so that one stalled
round cannot decide a result.

Conditions:
  alone      worker A runs the method, worker B idles
  two-proc   A and B run it at the same time (two ranks loading on one host)
  beside-hog A runs it while a third process spins on one core (CPU-bound)

Methods (all write the Ascend layout (E, K, N), except ``widen``):
  widen      uint8 -> int16 ``copy_`` of the same bytes (E, N, K): moves exactly what an
             expansion must move, with torch's default threads; the memory bound
  naive      per expert ``(w.float() * scale_expanded).to(bfloat16)``, written transposed
  vllm_1l    vLLM's ``scaled_dequantize`` one-liner on the stacked layer (E, N, K) with
             128x128 groups, then written transposed (vLLM's own function when vllm imports)
  ours       drama3_patches.kernels.fp8.dequant_experts, default settings (per expert, the
             faster of default_threads() workers and one, as measured)
  ours_mt    the default kernel with num_threads=default_threads() fixed
  ours_1t    the default kernel with num_threads=1
  ours_torch default settings with kernel="torch" (the fallback without a C compiler)

``peak+`` is the peak RSS during the run (alone) above the RSS before it (inputs
and output already resident): memory beyond the output, max over rounds, also
in units of one expert's bfloat16 size.  ``bits`` compares the first and last
expert with the definition, bit for bit.  Run::

    python benchmarks/fp8_expand.py                   # 12 experts of 1536 x 2048, 7 rounds
    python benchmarks/fp8_expand.py --rounds 11 --methods widen,naive,ours
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
METHODS = ("widen", "naive", "vllm_1l", "ours", "ours_mt", "ours_1t", "ours_torch")
CONDITIONS = ("alone", "two-proc", "beside-hog")
_EXPANSIONS = ("naive", "vllm_1l", "ours", "ours_mt", "ours_1t", "ours_torch")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _trim_heap() -> None:
    # Free heap pages left resident by earlier runs would otherwise hide in the baseline.
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


def _worker(experts: int, n: int, k: int) -> None:
    """Serve ``{"method": m, "peak": bool}`` lines on stdin with one JSON line each."""
    import torch

    from drama3_patches.kernels import fp8

    try:
        from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, scaled_dequantize

        vllm_source = "vllm"
    except Exception:  # the same one-liner, for hosts without vllm
        GroupShape = None
        vllm_source = "local"

        def scaled_dequantize(x_q, x_s, group_shape=None, out_dtype=torch.float32):
            s = x_s.to(torch.float32).repeat_interleave(group_shape[0], -2).repeat_interleave(group_shape[1], -1)
            return (x_q.to(torch.float32) * s).to(out_dtype)

    gen = torch.Generator().manual_seed(1234)
    codes = torch.randint(0, 255, (experts, n, k), dtype=torch.uint8, generator=gen)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # finite codes: a plain equality is the bit check
    w_stack = codes.view(torch.float8_e4m3fn)
    w = list(w_stack.unbind(0))
    s_stack = torch.rand(experts, -(-n // 128), -(-k // 128), generator=gen) * 1e-2
    s = list(s_stack.unbind(0))
    out = torch.zeros(experts, k, n, dtype=torch.bfloat16)  # paged in before any clock starts
    wide = torch.zeros(experts, n, k, dtype=torch.int16)
    group = GroupShape(128, 128) if GroupShape is not None else (128, 128)

    def run(method: str) -> None:
        if method == "widen":
            wide.copy_(codes)
        elif method == "naive":
            for e in range(experts):
                out[e].copy_(fp8.reference_dequant(w[e], s[e]).t())
        elif method == "vllm_1l":
            out.copy_(scaled_dequantize(w_stack, s_stack, group_shape=group, out_dtype=torch.bfloat16).transpose(1, 2))
        elif method == "ours":
            fp8.dequant_experts(list(w), list(s), out)  # fresh containers: the master lists stay
        elif method == "ours_torch":
            fp8.dequant_experts(list(w), list(s), out, kernel="torch")
        elif method == "ours_mt":
            fp8.dequant_experts(list(w), list(s), out, num_threads=fp8.default_threads())
        elif method == "ours_1t":
            fp8.dequant_experts(list(w), list(s), out, num_threads=1)
        else:
            raise ValueError(method)

    for m in METHODS:  # page in code paths (and build the native kernel) before timing
        run(m)
    info = {"ready": True, "threads": torch.get_num_threads(), "kernel": fp8.resolve_kernel(),
            "default_threads": fp8.default_threads(), "vllm_1l": vllm_source}
    if info["kernel"] == "native":
        from drama3_patches.kernels import fp8_native

        info["simd"] = {2: "AVX2", 1: "SSE4.1", 0: "scalar"}.get(fp8_native.info()["simd"])
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        peak_ok = False
        if req.get("peak"):
            _trim_heap()
            base = _rss_kib("VmRSS")
            peak_ok = _reset_peak()
        t0 = time.perf_counter()
        run(req["method"])
        elapsed = time.perf_counter() - t0
        extra = (_rss_kib("VmHWM") - base) * 1024 if peak_ok else None
        bits = None
        if req.get("check") and req["method"] in _EXPANSIONS:
            bits = all(torch.equal(out[e].t().contiguous().view(torch.int16),
                                   fp8.reference_dequant(w[e], s[e]).view(torch.int16)) for e in (0, experts - 1))
        print(json.dumps({"time": elapsed, "peak_extra": extra, "bits": bits}), flush=True)


class _Worker:
    def __init__(self, args) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--experts", str(args.experts), "--shape", args.shape],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return json.loads(line)

    def send(self, method: str, peak: bool = False, check: bool = False) -> None:
        self.proc.stdin.write(json.dumps({"method": method, "peak": peak, "check": check}) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True:\n    pass"])


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=12)
    ap.add_argument("--shape", default="1536x2048", help="per-expert N x K of the fp8 weight")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of every method in every condition (medians)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", action="store_true", help="print the raw times too")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    n, k = (int(x) for x in args.shape.split("x"))
    if args.worker:
        _worker(args.experts, n, k)
        return 0
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")

    load_before = _loadavg()
    workers = [_Worker(args), _Worker(args)]
    a, b = workers
    times = {(m, c): [] for m in methods for c in CONDITIONS}
    peaks = {m: [] for m in methods}
    bits = {m: True for m in methods}
    hog = None
    try:
        for r in range(args.rounds):
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            for cond in CONDITIONS:
                if cond == "beside-hog":
                    hog = _hog()
                    time.sleep(0.3)  # let it reach its core
                for m in order:
                    if cond == "two-proc":
                        a.send(m)
                        b.send(m)
                        times[(m, cond)] += [a._read()["time"], b._read()["time"]]
                        continue
                    a.send(m, peak=cond == "alone", check=(r == 0 and cond == "alone"))
                    res = a._read()
                    times[(m, cond)].append(res["time"])
                    if res["peak_extra"] is not None:
                        peaks[m].append(res["peak_extra"])
                    if res["bits"] is not None:
                        bits[m] = bits[m] and res["bits"]
                if hog is not None:
                    hog.kill()
                    hog.wait()
                    hog = None
    finally:
        if hog is not None:
            hog.kill()
        for w in workers:
            w.close()

    med = {key: statistics.median(v) for key, v in times.items()}
    mib = 1 << 20
    expert_bf16 = n * k * 2
    info = a.info
    print(f"{args.experts} experts of {n}x{k} fp8 -> (E, K, N) bf16 ({args.experts * expert_bf16 / mib:.0f} MiB "
          f"out); cpus {os.cpu_count()}, load avg before {load_before}, after {_loadavg()}")
    print(f"ours: kernel {info['kernel']}{' (' + info['simd'] + ')' if info.get('simd') else ''}, default threads "
          f"{info['default_threads']}; torch threads {info['threads']}; vllm_1l from {info['vllm_1l']}; "
          f"{args.rounds} rounds, medians (two-proc: both processes' times)")
    head = f"{'method':11s}" + "".join(f"{c + ' ms':>15s}" for c in CONDITIONS)
    head += "".join(f"{'naive/' + c[:5]:>13s}" for c in CONDITIONS)
    head += f"{'/widen':>8s}{'peak+ MiB':>11s}{'/expert':>9s}{'bits':>6s}"
    print(head)
    for m in methods:
        row = f"{m:11s}" + "".join(f"{med[(m, c)] * 1e3:15.1f}" for c in CONDITIONS)
        for c in CONDITIONS:
            row += f"{med[('naive', c)] / med[(m, c)]:12.2f}x" if "naive" in methods else f"{'-':>13s}"
        row += f"{med[(m, 'alone')] / med[('widen', 'alone')]:7.2f}x" if "widen" in methods else f"{'-':>8s}"
        peak = max(peaks[m]) if peaks[m] else None
        row += f"{peak / mib:11.1f}{peak / expert_bf16:9.2f}" if peak is not None else f"{'n/a':>11s}{'n/a':>9s}"
        row += f"{str(bits[m]) if m in _EXPANSIONS else '-':>6s}"
        print(row)
    print("naive/X = naive's median time / X's in that condition (higher is faster); /widen = X's time alone / "
          "widen's alone (1.00 = at the memory bound)")
    if args.json:
        print(json.dumps({f"{m}|{c}": v for (m, c), v in times.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
