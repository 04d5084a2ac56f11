"""Block-FP8 -> bfloat16 expansion of MoE expert weights on the CPU.

Checkpoints quantised with 128x128 blocks store each expert's weight as
``float8_e4m3fn`` of shape ``(N, K)`` with a float32 ``weight_scale_inv`` of
shape ``(ceil(N/bn), ceil(K/bk))``.  The dense value is, by definition,
:func:`reference_dequant` (``(w.float() * scale_expanded).to(bfloat16)``, in :mod:`.fp8_format`); the
functions here produce the same bits, faster and in bounded memory:

* The torch path's fp8 -> float32 step uses the bit layout instead of torch's
  scalar fp8 conversion (about 8 ns an element on x86): the byte is sign-extended to
  int16 and its 7 magnitude bits shifted to the float16 exponent/mantissa
  position, which makes a float16 worth ``v * 2**-8`` (subnormal codes become
  float16 subnormals, which the vectorised float16 -> float32 conversion
  handles exactly and at full speed, unlike float32 subnormals in a multiply).
  The ``2**8`` goes into the block scale, so one float32 multiply gives the
  exact product ``v * s`` rounded once, as in the reference.  The two NaN
  codes (which the trick turns into finite values) are masked back in.  The
  float32 -> bfloat16 rounding is the same contiguous conversion the reference
  uses, so even NaN encodings match.
* Output may be written transposed, ``(K, N)`` per expert, which is the layout
  vLLM-Ascend's bf16 MoE method keeps after ``process_weights_after_loading``
  (``w13`` as ``(E, H, 2I)``, ``w2`` as ``(E, I, H)``); the transpose is done
  on the 1-byte fp8 codes, never on a dense copy.  (A transposed write of the
  bf16 result would also change NaN encodings: torch's strided float32 ->
  bfloat16 conversion gives 0x7FC0 where the contiguous one gives 0xFFFF.)
* Two implementations give the same bits.  ``native`` (the default where a C
  compiler is present): one fused pass per expert, :mod:`.fp8_native`, a small
  C kernel built on first use and self-checked against the definition.
  ``torch``: the same arithmetic in torch ops, in row chunks.  Choose with
  ``kernel=`` or ``DRAMA3_PATCHES_FP8_KERNEL=auto|native|torch``.
* Parallelism never joins threads after each small op (torch's intra-op pool
  does, and on a busy host one descheduled thread then stalls every op):
  ``num_threads`` workers take work units from one shared counter (C threads
  in the native kernel; Python threads running single-threaded torch ops in
  the torch path), so a descheduled worker only delays the unit it holds.
  Workers still meet once per expert, so by default :func:`dequant_experts`
  measures, expert by expert, whether ``min(torch.get_num_threads(), usable
  cores, 8)`` workers or one is faster right now, and keeps the faster (a
  busy host favours one).  ``num_threads=`` or ``DRAMA3_PATCHES_FP8_THREADS``
  fixes the count instead.
* Memory beyond the output: the native kernel needs at most ``N*K`` bytes of
  scratch (one transposed unit per worker, capped; plus ``N*K`` for a copy of
  codes whose columns are not contiguous); the torch path at most
  ``N*K`` bytes for the transposed codes plus ``5 * chunk_rows * width`` bytes
  per worker, under 90% of one bfloat16 expert with the default chunk size.
  The torch path uses the output rows as int16 scratch.
* :func:`dequant_experts` takes the per-expert sources out of the caller's
  container (list or dict) and drops each before taking the next, so the fp8
  copy of an expert is gone before the next expert's dense data is produced.
  An output on another device gets each expert through one reusable host
  staging buffer and a blocking copy.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import MutableMapping, MutableSequence
from typing import Callable, Union

import torch

# One way: this module chooses and calls the native kernel; both take the format from the leaf.
from drama3_patches.kernels import fp8_native
from drama3_patches.kernels.fp8_format import BLOCK, expected_scale_shape, reference_dequant
from drama3_patches.logger import init_logger, warning_once

logger = init_logger(__name__)

# dequant_experts logs its progress at INFO every this many experts of one call.
PROGRESS_EVERY = 64

__all__ = [
    "BLOCK",
    "dequant_block_fp8",
    "dequant_experts",
    "default_threads",
    "expected_scale_shape",
    "resolve_kernel",
    "reference_dequant",
]

_HALF_BIAS_SHIFT = 256.0  # 2**(15 - 7): float16 exponent bias minus e4m3's
_SIGN_AND_MAGNITUDE = -16512  # 0xBF80 as int16: sign bit 15 and bits 13..7
_CHUNK_CHOICES = (256, 128, 64, 32, 16, 8)
_TRANSPOSE_SLAB = 32
_SCRATCH_BYTES_PER_ELEMENT = 5  # a float32 and a uint8 buffer per worker
_MAX_DEFAULT_THREADS = 8  # the expansion is memory bound well before this many cores
# Operator knobs (README's environment table): a fixed worker count, and the kernel choice.
THREADS_ENV = "DRAMA3_PATCHES_FP8_THREADS"
KERNEL_ENV = "DRAMA3_PATCHES_FP8_KERNEL"
KERNELS = ("auto", "native", "torch")
ExpertSource = Union[MutableSequence, MutableMapping]


def _env_threads() -> int | None:
    """``DRAMA3_PATCHES_FP8_THREADS`` as a positive integer; None when unset or invalid (warned once)."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value >= 1:
        return value
    warning_once(logger, THREADS_ENV, "%s=%r is not a positive integer; using the default", THREADS_ENV, raw)
    return None


def default_threads() -> int:
    """Workers per expansion: ``DRAMA3_PATCHES_FP8_THREADS`` if set to a positive integer, else
    ``min(torch.get_num_threads(), usable cores, 8)`` (torch's count is the operator's budget
    for this process; more than 8 workers gain nothing on a memory-bound pass)."""
    fixed = _env_threads()
    if fixed:
        return fixed
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores, _MAX_DEFAULT_THREADS))


def resolve_kernel(kernel: str | None = None) -> str:
    """``native`` or ``torch``: the argument, else ``DRAMA3_PATCHES_FP8_KERNEL``, else ``auto``
    (native where it builds and passes its self-check).  Asking for ``native`` where it cannot
    be built raises, naming the reason."""
    choice = kernel
    if choice is None:
        choice = os.environ.get(KERNEL_ENV, "").strip().lower() or "auto"
        if choice not in KERNELS:
            warning_once(logger, KERNEL_ENV, "%s=%r is not one of %s; using auto", KERNEL_ENV, choice,
                         "/".join(KERNELS))
            choice = "auto"
    elif choice not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {choice!r}")
    if choice == "torch":
        return "torch"
    if fp8_native.available():
        return "native"
    if choice == "native":
        raise RuntimeError(f"fp8 expansion: the native kernel was asked for but is unavailable: "
                           f"{fp8_native.unavailable_reason()}")
    return "torch"


def _check(weight: torch.Tensor, scale: torch.Tensor, block_size, where: str) -> None:
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"{where}: expected a 2-D float8_e4m3fn weight, got dtype {weight.dtype} shape {tuple(weight.shape)}"
        )
    want = expected_scale_shape(weight.shape, block_size)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"{where}: weight_scale_inv shape {tuple(scale.shape)} does not match weight shape "
            f"{tuple(weight.shape)} with block {tuple(block_size)} (expected scale shape {want})"
        )
    if not scale.is_floating_point():
        raise ValueError(f"{where}: weight_scale_inv must be floating point, got {scale.dtype}")
    if weight.device.type != "cpu" or scale.device.type != "cpu":
        raise ValueError(f"{where}: the CPU expansion needs CPU tensors, got {weight.device} and {scale.device}")


def _fast_path_exact() -> bool:
    # The trick relies on float16 subnormals converting exactly; a process running
    # with flush-to-zero / denormals-are-zero would turn them into 0.
    probe = torch.full((64,), 2.0**-20, dtype=torch.float16).float()
    return bool((probe == 2.0**-20).all())


def default_chunk_rows(rows: int, width: int, transposed: bool, workers: int = 1) -> int:
    """Rows per step so that scratch + transposed codes stay under 90% of one bf16 expert."""
    budget = rows * width * 2 * 9 // 10 - (rows * width if transposed else 0)
    for choice in _CHUNK_CHOICES:
        if workers * choice * width * _SCRATCH_BYTES_PER_ELEMENT <= budget:
            return min(choice, rows)
    return min(_CHUNK_CHOICES[-1], rows)


class _Scratch:
    """One worker's chunk buffers."""

    def __init__(self, chunk_rows: int, width: int) -> None:
        self.f32 = torch.empty(chunk_rows, width, dtype=torch.float32)
        self.u8 = torch.empty(chunk_rows, width, dtype=torch.uint8)


class _Workers:
    """One expansion call's workers and buffers.

    ``kernel == "native"``: the C kernel runs its own ``n`` workers per expert.  ``"torch"``:
    row chunks run on ``n`` Python threads (torch ops release the GIL) with torch's own thread
    count at 1 for the call, because torch's intra-op pool joins all its threads after every
    small op and on a busy host one descheduled thread then stalls every op.  Independent
    chunks taken from a shared iterator only meet once per expert, and a slow thread just
    takes fewer chunks.
    """

    def __init__(self, n: int, chunk_rows: int, width: int, kernel: str = "torch") -> None:
        self.n = max(1, n)
        self.active = self.n  # workers used for the next expert (the adaptive choice may lower it)
        self.kernel = kernel
        self.scratches = [_Scratch(chunk_rows, width) for _ in range(self.n)] if kernel == "torch" else []
        self.chunk_rows = chunk_rows
        self.codes: torch.Tensor | None = None  # transposed fp8 codes of one expert
        self._pool = None
        self._saved_threads = None

    def codes_for(self, rows: int, cols: int) -> torch.Tensor:
        if self.codes is None or self.codes.numel() < rows * cols:
            self.codes = None
            self.codes = torch.empty(rows * cols, dtype=torch.int8)
        return self.codes[: rows * cols].view(rows, cols)

    def __enter__(self) -> "_Workers":
        if self.kernel == "torch":
            # Process-wide for the duration of the call: new pool threads read it on first use.
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(1)
            if self.n > 1:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(self.n - 1, thread_name_prefix="fp8-expand")
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None

    def run(self, chunks: list[tuple[int, int]], fn: Callable[[int, int, _Scratch], None]) -> None:
        if self._pool is None or len(chunks) == 1 or self.active == 1:
            for start, stop in chunks:
                fn(start, stop, self.scratches[0])
            return
        import threading

        pending = iter(chunks)
        lock = threading.Lock()

        def work(scratch: _Scratch) -> None:
            while True:
                with lock:
                    item = next(pending, None)
                if item is None:
                    return
                fn(item[0], item[1], scratch)

        futures = [self._pool.submit(work, s) for s in self.scratches[1:self.active]]
        try:
            work(self.scratches[0])
        finally:
            for fut in futures:
                fut.result()


def _scale_segment(f: torch.Tensor, scales: torch.Tensor, nblocks: int, row_block: int, col_block: int) -> None:
    """Multiply ``f`` (rows = ``nblocks`` whole row blocks, or part of one) by its block scales in place."""
    rows, cols = f.shape
    per = row_block if nblocks > 1 else rows
    full_cols = cols - cols % col_block
    n_full = full_cols // col_block
    if n_full:
        f[:, :full_cols].view(nblocks, per, n_full, col_block).mul_(scales[:, :n_full].reshape(nblocks, 1, n_full, 1))
    if full_cols < cols:
        f[:, full_cols:].view(nblocks, per, cols - full_cols).mul_(scales[:, n_full].reshape(nblocks, 1, 1))


def _chunks(rows: int, row_block: int, chunk_rows: int) -> list[tuple[int, int]]:
    """Row ranges of at most ``chunk_rows``: whole scale blocks, or parts of one block."""
    step = chunk_rows - chunk_rows % row_block if chunk_rows >= row_block else chunk_rows
    out, start = [], 0
    while start < rows:
        if step % row_block == 0:
            stop = min(start + step, rows)
        else:  # chunks smaller than a block never straddle two blocks
            stop = min(start + step, (start // row_block + 1) * row_block, rows)
        out.append((start, stop))
        start = stop
    return out


def _expand_rows(codes: torch.Tensor, scale_rows: torch.Tensor, row_block: int, col_block: int,
                 out: torch.Tensor, workers: _Workers, fast: bool) -> None:
    """``out[r, c] = bf16(fp8(codes[r, c]) * scale_rows[r // row_block, c // col_block])``.

    ``codes`` is a contiguous int8 view of the fp8 data, ``out`` a CPU
    bfloat16 tensor of the same shape whose rows are contiguous.
    """
    rows, _ = codes.shape
    fold = fast and bool(scale_rows.abs().max() < 2.0**100) if scale_rows.numel() else False
    scales = scale_rows * _HALF_BIAS_SHIFT if fold else scale_rows  # exact: a power of two

    def expand(start: int, stop: int, scratch: _Scratch) -> None:
        r = stop - start
        src = codes[start:stop]
        dst = out[start:stop]
        f = scratch.f32[:r]
        if fast:
            # The output rows double as the int16 scratch: they are overwritten last.
            half = dst.view(torch.int16)
            half.copy_(src)  # sign-extends into bits 7..15
            half.mul_(128)  # << 7 (torch's int16 multiply is faster than its shift)
            half.bitwise_and_(_SIGN_AND_MAGNITUDE)
            f.copy_(half.view(torch.float16))  # exact, = v * 2**-8
            # e4m3fn NaN codes (0x7F/0xFF) came out finite (+-1.875).  Rare: a cheap byte test first.
            flag = scratch.u8[:r]
            torch.bitwise_or(src.view(torch.uint8), 0x80, out=flag)
            if int(flag.max()) == 0xFF:
                f.masked_fill_(flag == 0xFF, float("nan"))
            if not fold:
                f.mul_(_HALF_BIAS_SHIFT)
        else:
            f.copy_(src.view(torch.float8_e4m3fn))
        # Block scales: whole row blocks together, then a trailing partial block.
        b0 = start // row_block
        whole = (r // row_block) if start % row_block == 0 else 0
        if whole:
            _scale_segment(f[: whole * row_block], scales[b0 : b0 + whole], whole, row_block, col_block)
        if whole * row_block < r:
            _scale_segment(f[whole * row_block :], scales[b0 + whole : b0 + whole + 1], 1, row_block, col_block)
        dst.copy_(f)  # contiguous float32 -> bfloat16, as in the reference

    workers.run(_chunks(rows, row_block, workers.chunk_rows), expand)


def dequant_block_fp8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    transposed: bool = False,
    out: torch.Tensor | None = None,
    block_size=BLOCK,
    chunk_rows: int | None = None,
    num_threads: int | None = None,
    kernel: str | None = None,
    where: str = "weight",
    _workers: _Workers | None = None,
) -> torch.Tensor:
    """Expand one ``(N, K)`` block-FP8 weight to bfloat16.

    Returns ``(N, K)``, or ``(K, N)`` (the transpose, contiguous) when
    ``transposed``; ``out`` (CPU, bfloat16, that shape, rows contiguous)
    receives the result when given.  ``num_threads`` workers (default
    :func:`default_threads`), ``kernel`` as in :func:`resolve_kernel`;
    ``chunk_rows`` sizes the torch path's row chunks.
    """
    if _workers is None:
        rows, width = reversed(weight.shape) if transposed else weight.shape
        threads = num_threads or default_threads()
        chosen = resolve_kernel(kernel)
        chunk = chunk_rows or default_chunk_rows(rows, width, transposed, threads)
        with _Workers(threads, chunk, width, chosen) as workers:
            return dequant_block_fp8(weight, scale, transposed=transposed, out=out, block_size=block_size,
                                     where=where, _workers=workers)
    _check(weight, scale, block_size, where)
    n, k = weight.shape
    bn, bk = block_size
    shape = (k, n) if transposed else (n, k)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16)
    elif tuple(out.shape) != shape or out.dtype != torch.bfloat16 or out.device.type != "cpu" or out.stride(-1) != 1:
        raise ValueError(f"{where}: out must be a CPU bfloat16 tensor of shape {shape} with contiguous rows")
    if _workers.kernel == "native":
        codes = weight.view(torch.uint8)
        if codes.stride(1) != 1:
            codes = codes.contiguous()
        fp8_native.expand(codes, scale.to(torch.float32), out, transposed=transposed, block_size=(bn, bk),
                          threads=_workers.active)
        return out
    scale32 = scale.to(torch.float32)
    codes = weight.view(torch.int8)
    if transposed:
        # Transpose the 1-byte codes, not the dense result.  Slabs of 32 source rows (as uint8,
        # which torch copies faster than int8) beat torch's whole-matrix transpose by about 1.6x
        # on one thread, and spread over the workers.
        t = _workers.codes_for(k, n)
        src, dst = codes.view(torch.uint8), t.view(torch.uint8)
        slabs = [(a, min(a + _TRANSPOSE_SLAB, n)) for a in range(0, n, _TRANSPOSE_SLAB)]
        _workers.run(slabs, lambda a, b, _scratch: dst[:, a:b].copy_(src[a:b].t()))
        codes, scale32, bn, bk = t, scale32.t(), bk, bn
    elif not codes.is_contiguous():
        codes = codes.contiguous()
    _expand_rows(codes, scale32, bn, bk, out, _workers, _fast_path_exact())
    return out


class _AdaptiveThreads:
    """Per expert, the faster of ``many`` workers and one, by measured wall time.

    Workers meet at the end of every expert; on a busy host a descheduled worker then holds
    the others up for the rest of its time slice, and one worker can beat several.  Both
    counts are tried on the first experts, the faster is kept, and the other is tried again
    every ``PROBE_EVERY`` experts, since the load changes.  (Experts of one call have one
    shape, so their times compare.)
    """

    PROBE_EVERY = 8

    def __init__(self, many: int) -> None:
        self.options = (many, 1) if many > 1 else (1,)
        self.seconds: dict[int, float] = {}
        self.count = 0

    def choose(self) -> int:
        for option in self.options:
            if option not in self.seconds:
                return option
        best = min(self.options, key=self.seconds.__getitem__)
        if len(self.options) > 1 and self.count % self.PROBE_EVERY == self.PROBE_EVERY - 1:
            return next(o for o in self.options if o != best)
        return best

    def record(self, option: int, seconds: float) -> None:
        old = self.seconds.get(option)
        self.seconds[option] = seconds if old is None else 0.5 * (old + seconds)
        self.count += 1


def _take(container: ExpertSource, index: int):
    if isinstance(container, MutableMapping):
        return container.pop(index)
    item = container[index]
    container[index] = None  # hand-over: the caller no longer holds this expert
    return item


def dequant_experts(
    weights: ExpertSource,
    scales: ExpertSource,
    out: torch.Tensor,
    *,
    transposed: bool = True,
    block_size=BLOCK,
    chunk_rows: int | None = None,
    num_threads: int | None = None,
    kernel: str | None = None,
    name: str = "experts",
    on_expert_done: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Expand ``E`` experts into ``out`` (``(E, K, N)`` if ``transposed`` else ``(E, N, K)``).

    ``weights``/``scales`` hold one fp8 weight / float32 scale per expert
    (list with entries for ``0..E-1``, or dict keyed by expert index).  Each
    entry is taken out of the container (list slot set to ``None``, dict key
    popped) and released once its expert is written, before the next expert
    is taken: hand over the only reference to make the memory bound real.

    ``out`` may live on another device: each expert is then expanded into one
    reusable CPU staging buffer and copied with a blocking copy.
    ``num_threads`` workers take work units from a shared counter; without
    ``num_threads`` (or ``DRAMA3_PATCHES_FP8_THREADS``) each expert uses either
    :func:`default_threads` workers or one, whichever measured faster on this
    call's earlier experts (:class:`_AdaptiveThreads`).  ``kernel`` as in
    :func:`resolve_kernel`.
    """
    for what, source in (("weights", weights), ("scales", scales)):
        if isinstance(source, torch.Tensor):
            # A stacked tensor cannot hand its experts over one at a time (the memory bound).
            raise TypeError(f"{name}: {what} must be a list or dict of per-expert tensors, not one stacked "
                            f"tensor; pass list({what}.unbind(0)) and drop your own reference")
    num_experts = out.shape[0]
    if out.dtype != torch.bfloat16 or out.dim() != 3:
        raise ValueError(f"{name}: out must be a 3-D bfloat16 tensor, got {out.dtype} {tuple(out.shape)}")
    on_cpu = out.device.type == "cpu"
    rows, width = out.shape[1], out.shape[2]
    explicit = num_threads or _env_threads()
    threads = explicit or default_threads()
    adaptive = None if explicit else _AdaptiveThreads(threads)
    chosen = resolve_kernel(kernel)
    workers = _Workers(threads, chunk_rows or default_chunk_rows(rows, width, transposed, threads), width, chosen)
    staging = None if on_cpu else torch.empty(rows, width, dtype=torch.bfloat16)
    # Progress at INFO: a line every PROGRESS_EVERY experts of a long call, and one per call
    # (a layer's w13 or w2, or a TP shard of w13). Experts take milliseconds each, so the clock
    # reads and the level check per expert cost nothing measurable.
    started = time.perf_counter()
    say = logger.isEnabledFor(logging.INFO)
    with workers:
        for e in range(num_experts):
            if adaptive is not None:
                workers.active = adaptive.choose()
            seconds = _expand_one(weights, scales, e, out, staging, transposed, block_size, name, workers)
            if adaptive is not None:
                adaptive.record(workers.active, seconds)
            if on_expert_done is not None:
                on_expert_done(e)
            if say and (e + 1) % PROGRESS_EVERY == 0 and e + 1 < num_experts:
                logger.info("%s: %d/%d experts expanded to bfloat16, %.2f s", name, e + 1, num_experts,
                            time.perf_counter() - started)
    if say:
        how = (f"{threads} or 1 worker(s), chosen per expert by measured time" if adaptive is not None
               else f"{threads} worker(s)")
        logger.info("%s: expanded %d experts to bfloat16 (%d x %d each, %.1f MiB in all) in %.2f s; kernel %s, %s%s",
                    name, num_experts, rows, width, out.numel() * 2 / 2 ** 20, time.perf_counter() - started, chosen,
                    how, "" if on_cpu else f", copied to {out.device}")
    return out


def _expand_one(weights, scales, e, out, staging, transposed, block_size, name, workers) -> float:
    """Expand expert ``e``; returns the seconds the expansion itself took."""
    weight = _take(weights, e)
    scale = _take(scales, e)
    where = f"{name} expert {e}"
    if weight is None or scale is None:
        raise ValueError(f"{where}: weight or weight_scale_inv missing (already taken?)")
    want = (weight.shape[1], weight.shape[0]) if transposed else tuple(weight.shape)
    if tuple(out.shape[1:]) != tuple(want):
        raise ValueError(
            f"{where}: weight shape {tuple(weight.shape)} does not fit out shape {tuple(out.shape)} "
            f"(transposed={transposed})"
        )
    target = out[e] if staging is None else staging
    start = time.perf_counter()
    dequant_block_fp8(weight, scale, transposed=transposed, out=target, block_size=block_size,
                      where=where, _workers=workers)
    seconds = time.perf_counter() - start
    del weight, scale  # this frame held the last reference: the fp8 source is freed here
    if staging is not None:
        out[e].copy_(staging, non_blocking=False)  # staging is reused right away
    return seconds
