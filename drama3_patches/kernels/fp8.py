"""Block-FP8 -> bfloat16 expansion of MoE expert weights on the CPU.

Checkpoints quantised with 128x128 blocks store each expert's weight as
``float8_e4m3fn`` of shape ``(N, K)`` with a float32 ``weight_scale_inv`` of
shape ``(ceil(N/bn), ceil(K/bk))``.  The dense value is, by definition,
:func:`reference_dequant` (``(w.float() * scale_expanded).to(bfloat16)``); the
functions here produce the same bits, faster and in bounded memory:

* The fp8 -> float32 step uses the bit layout instead of torch's scalar fp8
  conversion (about 8 ns an element on x86): the byte is sign-extended to
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
* Work is streamed one expert at a time, in row chunks; every op is big
  enough for torch's intra-op (OpenMP) threads, the default.  On a host
  whose cores are busy with other processes, joining all threads after every
  op stalls; ``num_threads=k`` then runs chunks on k Python threads instead
  (torch ops release the GIL) with torch's own threads at 1 for the call.
  The output rows double as int16 scratch.  Scratch memory beyond the output is
  at most ``N*K`` bytes (the transposed codes) plus ``5 * chunk_rows * width``
  bytes per thread; the default chunk size keeps the sum under 90% of one
  expert's bfloat16 size.
* :func:`dequant_experts` takes the per-expert sources out of the caller's
  container (list or dict) and drops each before taking the next, so the fp8
  copy of an expert is gone before the next expert's dense data is produced.
  An output on another device gets each expert through one reusable host
  staging buffer and a blocking copy.
"""

from __future__ import annotations

from collections.abc import MutableMapping, MutableSequence
from typing import Callable, Union

import torch

__all__ = [
    "BLOCK",
    "dequant_block_fp8",
    "dequant_experts",
    "expected_scale_shape",
    "reference_dequant",
]

BLOCK = (128, 128)
_HALF_BIAS_SHIFT = 256.0  # 2**(15 - 7): float16 exponent bias minus e4m3's
_SIGN_AND_MAGNITUDE = -16512  # 0xBF80 as int16: sign bit 15 and bits 13..7
_CHUNK_CHOICES = (256, 128, 64, 32, 16, 8)
_TRANSPOSE_SLAB = 32
_SCRATCH_BYTES_PER_ELEMENT = 5  # a float32 and a uint8 buffer per worker

ExpertSource = Union[MutableSequence, MutableMapping]


def expected_scale_shape(weight_shape, block_size=BLOCK) -> tuple[int, int]:
    n, k = weight_shape
    bn, bk = block_size
    return (-(-n // bn), -(-k // bk))


def reference_dequant(weight: torch.Tensor, scale: torch.Tensor, block_size=BLOCK) -> torch.Tensor:
    """The definition: ``(w.float() * scale_expanded).to(torch.bfloat16)`` (slow, memory hungry)."""
    n, k = weight.shape
    bn, bk = block_size
    expanded = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.float() * expanded).to(torch.bfloat16)


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
        self.chunk_rows = chunk_rows
        self.f32 = torch.empty(chunk_rows, width, dtype=torch.float32)
        self.u8 = torch.empty(chunk_rows, width, dtype=torch.uint8)


class _Workers:
    """Runs row chunks on ``n`` Python threads, each torch op single-threaded.

    Small ops on torch's own intra-op pool join all threads after every op; on
    a busy host one descheduled thread then stalls every op.  Independent
    chunks on separate threads (torch ops release the GIL) only meet once per
    expert, and a slow thread just takes fewer chunks.
    """

    def __init__(self, n: int, chunk_rows: int, width: int) -> None:
        self.n = max(1, n)
        self.scratches = [_Scratch(chunk_rows, width) for _ in range(self.n)]
        self.codes: torch.Tensor | None = None  # transposed fp8 codes of one expert
        self._pool = None
        self._saved_threads = None

    @property
    def chunk_rows(self) -> int:
        return self.scratches[0].chunk_rows

    def codes_for(self, rows: int, cols: int) -> torch.Tensor:
        if self.codes is None or self.codes.numel() < rows * cols:
            self.codes = None
            self.codes = torch.empty(rows * cols, dtype=torch.int8)
        return self.codes[: rows * cols].view(rows, cols)

    def __enter__(self) -> "_Workers":
        if self.n > 1:
            from concurrent.futures import ThreadPoolExecutor

            # Process-wide for the duration of the call: new pool threads read it on first use.
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(1)
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
        if self._pool is None or len(chunks) == 1:
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

        futures = [self._pool.submit(work, s) for s in self.scratches[1:]]
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
    where: str = "weight",
    _workers: _Workers | None = None,
) -> torch.Tensor:
    """Expand one ``(N, K)`` block-FP8 weight to bfloat16.

    Returns ``(N, K)``, or ``(K, N)`` (the transpose, contiguous) when
    ``transposed``; ``out`` (CPU, bfloat16, that shape, rows contiguous)
    receives the result when given.  ``num_threads`` > 1 expands row chunks
    on that many Python threads instead of torch's intra-op threads.
    """
    if _workers is None:
        rows, width = reversed(weight.shape) if transposed else weight.shape
        threads = num_threads or 1
        with _Workers(threads, chunk_rows or default_chunk_rows(rows, width, transposed, threads), width) as workers:
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
    ``num_threads`` > 1 expands row chunks on that many Python threads, with
    torch's own thread count at 1 for the duration of the call; by default
    torch's intra-op threads parallelise each op.
    """
    num_experts = out.shape[0]
    if out.dtype != torch.bfloat16 or out.dim() != 3:
        raise ValueError(f"{name}: out must be a 3-D bfloat16 tensor, got {out.dtype} {tuple(out.shape)}")
    on_cpu = out.device.type == "cpu"
    rows, width = out.shape[1], out.shape[2]
    threads = num_threads or 1
    workers = _Workers(threads, chunk_rows or default_chunk_rows(rows, width, transposed, threads), width)
    staging = None if on_cpu else torch.empty(rows, width, dtype=torch.bfloat16)
    with workers:
        for e in range(num_experts):
            _expand_one(weights, scales, e, out, staging, transposed, block_size, name, workers)
            if on_expert_done is not None:
                on_expert_done(e)
    return out


def _expand_one(weights, scales, e, out, staging, transposed, block_size, name, workers) -> None:
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
    dequant_block_fp8(weight, scale, transposed=transposed, out=target, block_size=block_size,
                      where=where, _workers=workers)
    del weight, scale  # this frame held the last reference: the fp8 source is freed here
    if staging is not None:
        out[e].copy_(staging, non_blocking=False)  # staging is reused right away
