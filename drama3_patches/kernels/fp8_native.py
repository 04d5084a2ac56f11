"""A small C kernel for the block-FP8 -> bfloat16 expansion, built on first use.

Why C: the torch-op path needs a dozen passes over every element (and a join of
torch's threads after each small op); one fused pass reads each fp8 byte once
and writes each bfloat16 once, which is what the memory bound allows.

Why plain C through ``ctypes`` rather than a torch extension: it includes no
torch headers (builds in about a second with the system C compiler, no ABI
coupling to the installed torch) and ``ctypes`` releases the GIL for the call.
The source lives in this module, so it ships with the package as is.

How it computes (one scale ``s`` per 128x128 block):

* The definition, per element, is ``bf16(float32(code) * s)`` with the
  float32 product rounded once and the bfloat16 rounded to nearest even;
  ``expand_one`` below computes exactly that, and gives NaN results the bits
  torch's own contiguous float32 -> bfloat16 conversion gives NaN (probed at
  load time).
* Where ``|s|`` lies in ``[2**-120, 2**118]`` every product of a normal code is
  a normal float32 and a finite normal bfloat16, and both roundings commute
  with a power-of-two factor.  The result for a normal code (exponent e >= 1,
  mantissa f) is then the result for ``e = 1`` with ``e - 1`` added to the
  bfloat16 exponent field.  So a 16-entry table per block (the 8 subnormal
  codes and the 8 mantissas at ``e = 1``, computed by ``expand_one``), an
  integer add of ``e << 7`` and the code's sign bit give every result; the
  lookup is a byte shuffle (``pshufb``), 32 codes per step with AVX2, 16 with
  SSE4.1.  The two NaN codes are blended in.  Blocks whose scale is outside
  that range (zero, tiny, huge, inf, NaN), and builds without those
  instructions, use a 256-entry table of ``expand_one``.
* ``(N, K)`` output streams rows.  Transposed ``(K, N)`` output works in units
  of 128 source columns by 512 source rows: the codes are transposed in 8x8
  blocks (in registers) into a per-worker buffer, then each output row segment
  is converted; the strided output writes are what limits this layout.
* ``threads`` workers (pthreads) take units from one shared atomic counter, so
  a worker that the OS deschedules delays only the unit it holds; they meet
  once, at the end of the call.  Workers are capped so that their buffers stay
  within ``N*K`` bytes (half of one bfloat16 expert).

Everything is checked against :func:`drama3_patches.kernels.fp8.reference_dequant`
right after loading (all 256 codes, scale extremes, both layouts); a mismatch
disables this kernel with a warning and the torch-op path is used.

Environment: ``DRAMA3_PATCHES_FP8_KERNEL=auto|native|torch`` (see
``drama3_patches.kernels.fp8``), ``DRAMA3_PATCHES_CACHE_DIR`` (where the built
library is kept; default ``$XDG_CACHE_HOME/drama3_patches`` or
``~/.cache/drama3_patches``), ``CC`` (the compiler; default ``cc``/``gcc``/``clang``).

Trust: the library runs inside the server, often as root, so the cache is used
only when nobody else could have written it.  The folder (created 0700) must
belong to this user and be closed to group and others; the library must be a
regular file of this user, closed to others, opened without following a link
and loaded through that open descriptor.  A folder that fails (or an explicit
one that does) is named in a warning and the kernel is built in a fresh private
temporary folder for this process.  A cached library that does not load is
rebuilt once; every compiler call has a timeout.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

# Imported here, not inside the build: a fork while another thread is importing them
# would leave the child waiting on (or crashing in) a half-done import.
import torch

from drama3_patches.kernels.fp8 import expected_scale_shape, reference_dequant
from drama3_patches.logger import init_logger

logger = init_logger(__name__)

__all__ = ["available", "expand", "load", "unavailable_reason"]

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#if defined(__AVX2__) || defined(__SSE4_1__)
#include <immintrin.h>
#endif

#define BAND 128
#define SPAN 512
#define ROWS 8
#define MAX_THREADS 256

typedef struct {
    const uint8_t *src; int64_t n, k, src_stride;
    const float *scale; int64_t ss0, ss1;
    uint16_t *out; int64_t out_stride;
    int64_t bn, bk, sub_k, spans, nunits;
    int transposed;
    uint16_t nan_bits;
    int64_t next;
} job_t;

/* The definition for one code: bf16(RNE(float32(code) * s)); NaN results as nan_bits. */
static uint16_t expand_one(uint32_t b, float s, uint16_t nan_bits) {
    uint32_t m = b & 0x7Fu, bits, pb;
    float v, p;
    if (m == 0x7Fu) return nan_bits;
    if (m < 8u) {
        v = (float)m * 0x1p-9f; /* subnormal codes: m * 2**-9, exact */
    } else {
        bits = (m << 20) + (120u << 23); /* exponent e + (127 - 7), mantissa f */
        memcpy(&v, &bits, 4);
    }
    if (b & 0x80u) v = -v;
    p = v * s;
    memcpy(&pb, &p, 4);
    if ((pb & 0x7FFFFFFFu) > 0x7F800000u) return nan_bits;
    return (uint16_t)((pb + 0x7FFFu + ((pb >> 16) & 1u)) >> 16);
}

typedef struct {
    int fast;             /* the 16-entry table applies (see the module docstring) */
    uint8_t lo[16], hi[16];
    int have_lut;
    uint16_t lut[256];
    float s;
    uint16_t nan_bits;
} tables_t;

static void make_tables(tables_t *t, float s, uint16_t nan_bits) {
    uint32_t ab;
    float a;
    memcpy(&ab, &s, 4);
    ab &= 0x7FFFFFFFu;
    memcpy(&a, &ab, 4);
    t->s = s;
    t->nan_bits = nan_bits;
    t->have_lut = 0;
#if defined(__AVX2__) || defined(__SSE4_1__)
    t->fast = (a >= 0x1p-120f && a <= 0x1p118f); /* false for NaN */
#else
    t->fast = 0; /* without a byte shuffle the 256-entry table is faster */
#endif
    if (t->fast) {
        for (int f = 0; f < 8; f++) {
            uint16_t sub = expand_one((uint32_t)f, s, nan_bits);
            /* e = 1 result minus one exponent step, so that adding e << 7 gives code (e, f) */
            uint16_t nrm = (uint16_t)(expand_one((uint32_t)(8 + f), s, nan_bits) - 128u);
            t->lo[f] = (uint8_t)sub; t->hi[f] = (uint8_t)(sub >> 8);
            t->lo[8 + f] = (uint8_t)nrm; t->hi[8 + f] = (uint8_t)(nrm >> 8);
        }
    }
}

static void ensure_lut(tables_t *t) {
    if (!t->have_lut) {
        for (uint32_t b = 0; b < 256; b++) t->lut[b] = expand_one(b, t->s, t->nan_bits);
        t->have_lut = 1;
    }
}

static void convert_row(const uint8_t *in, uint16_t *out, int64_t cnt, tables_t *t) {
    int64_t i = 0;
    if (t->fast) {
#if defined(__AVX2__)
        const __m256i tlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->lo));
        const __m256i thi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->hi));
        const __m256i zero = _mm256_setzero_si256(), c7 = _mm256_set1_epi8(7), c8 = _mm256_set1_epi8(8);
        const __m256i c78 = _mm256_set1_epi8(0x78), c7f = _mm256_set1_epi8(0x7F), c80 = _mm256_set1_epi8((char)0x80);
        const __m256i nan = _mm256_set1_epi16((short)t->nan_bits);
        for (; i + 32 <= cnt; i += 32) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(in + i));
            __m256i e3 = _mm256_and_si256(x, c78);
            __m256i idx = _mm256_or_si256(_mm256_and_si256(x, c7), _mm256_andnot_si256(_mm256_cmpeq_epi8(e3, zero), c8));
            __m256i lo = _mm256_shuffle_epi8(tlo, idx);
            __m256i hi = _mm256_xor_si256(_mm256_shuffle_epi8(thi, idx), _mm256_and_si256(x, c80));
            __m256i isnan = _mm256_cmpeq_epi8(_mm256_and_si256(x, c7f), c7f);
            __m256i w0 = _mm256_add_epi16(_mm256_unpacklo_epi8(lo, hi), _mm256_slli_epi16(_mm256_unpacklo_epi8(e3, zero), 4));
            __m256i w1 = _mm256_add_epi16(_mm256_unpackhi_epi8(lo, hi), _mm256_slli_epi16(_mm256_unpackhi_epi8(e3, zero), 4));
            w0 = _mm256_blendv_epi8(w0, nan, _mm256_unpacklo_epi8(isnan, isnan));
            w1 = _mm256_blendv_epi8(w1, nan, _mm256_unpackhi_epi8(isnan, isnan));
            /* unpack works per 128-bit lane: w0 = codes 0-7 | 16-23, w1 = 8-15 | 24-31 */
            _mm256_storeu_si256((__m256i *)(out + i), _mm256_permute2x128_si256(w0, w1, 0x20));
            _mm256_storeu_si256((__m256i *)(out + i + 16), _mm256_permute2x128_si256(w0, w1, 0x31));
        }
#elif defined(__SSE4_1__)
        const __m128i tlo = _mm_loadu_si128((const __m128i *)t->lo);
        const __m128i thi = _mm_loadu_si128((const __m128i *)t->hi);
        const __m128i zero = _mm_setzero_si128(), c7 = _mm_set1_epi8(7), c8 = _mm_set1_epi8(8);
        const __m128i c78 = _mm_set1_epi8(0x78), c7f = _mm_set1_epi8(0x7F), c80 = _mm_set1_epi8((char)0x80);
        const __m128i nan = _mm_set1_epi16((short)t->nan_bits);
        for (; i + 16 <= cnt; i += 16) {
            __m128i x = _mm_loadu_si128((const __m128i *)(in + i));
            __m128i e3 = _mm_and_si128(x, c78);
            __m128i idx = _mm_or_si128(_mm_and_si128(x, c7), _mm_andnot_si128(_mm_cmpeq_epi8(e3, zero), c8));
            __m128i lo = _mm_shuffle_epi8(tlo, idx);
            __m128i hi = _mm_xor_si128(_mm_shuffle_epi8(thi, idx), _mm_and_si128(x, c80));
            __m128i isnan = _mm_cmpeq_epi8(_mm_and_si128(x, c7f), c7f);
            __m128i w0 = _mm_add_epi16(_mm_unpacklo_epi8(lo, hi), _mm_slli_epi16(_mm_unpacklo_epi8(e3, zero), 4));
            __m128i w1 = _mm_add_epi16(_mm_unpackhi_epi8(lo, hi), _mm_slli_epi16(_mm_unpackhi_epi8(e3, zero), 4));
            _mm_storeu_si128((__m128i *)(out + i), _mm_blendv_epi8(w0, nan, _mm_unpacklo_epi8(isnan, isnan)));
            _mm_storeu_si128((__m128i *)(out + i + 8), _mm_blendv_epi8(w1, nan, _mm_unpackhi_epi8(isnan, isnan)));
        }
#endif
        for (; i < cnt; i++) out[i] = expand_one(in[i], t->s, t->nan_bits);
        return;
    }
    ensure_lut(t);
    for (; i < cnt; i++) out[i] = t->lut[in[i]];
}

/* 8x8 byte transpose in registers: x[i] holds row i (byte j = column j). */
static void transpose8(uint64_t x[8]) {
    uint64_t t;
    for (int i = 0; i < 8; i += 2) {
        t = ((x[i] >> 8) ^ x[i + 1]) & 0x00FF00FF00FF00FFull; x[i + 1] ^= t; x[i] ^= t << 8;
    }
    for (int i = 0; i < 8; i += 4)
        for (int j = i; j < i + 2; j++) {
            t = ((x[j] >> 16) ^ x[j + 2]) & 0x0000FFFF0000FFFFull; x[j + 2] ^= t; x[j] ^= t << 16;
        }
    for (int j = 0; j < 4; j++) {
        t = ((x[j] >> 32) ^ x[j + 4]) & 0x00000000FFFFFFFFull; x[j + 4] ^= t; x[j] ^= t << 32;
    }
}

static inline __attribute__((always_inline)) void transpose_into(
        const job_t *j, uint8_t *tb, int64_t stride, int64_t n0, int64_t k0, int64_t tn, int64_t tk) {
    int64_t tn8 = tn & ~(int64_t)7, tk8 = tk & ~(int64_t)7;
    for (int64_t a = 0; a < tn8; a += 8) {
        const uint8_t *row = j->src + (n0 + a) * j->src_stride + k0;
        for (int64_t c = 0; c < tk8; c += 8) {
            uint64_t x[8];
            for (int i = 0; i < 8; i++) memcpy(&x[i], row + i * j->src_stride + c, 8);
            transpose8(x);
            for (int i = 0; i < 8; i++) memcpy(tb + (c + i) * stride + a, &x[i], 8);
        }
        for (int64_t c = tk8; c < tk; c++)
            for (int i = 0; i < 8; i++) tb[c * stride + a + i] = row[i * j->src_stride + c];
    }
    for (int64_t a = tn8; a < tn; a++)
        for (int64_t c = 0; c < tk; c++) tb[c * stride + a] = j->src[(n0 + a) * j->src_stride + k0 + c];
}

static inline __attribute__((always_inline)) void transposed_unit(
        const job_t *j, uint8_t *tb, tables_t *tabs, int64_t stride, int64_t n0, int64_t n1, int64_t k0,
        int64_t bc, int64_t tk) {
    transpose_into(j, tb, stride, n0, k0, n1 - n0, tk);
    int64_t nt = 0; /* one table per scale block along n (the caller sized tabs) */
    for (int64_t nb = n0; nb < n1; nb = (nb / j->bn + 1) * j->bn)
        make_tables(&tabs[nt++], j->scale[(nb / j->bn) * j->ss0 + bc * j->ss1], j->nan_bits);
    for (int64_t c = 0; c < tk; c++) {
        int64_t q = 0;
        for (int64_t nb = n0; nb < n1; q++) {
            int64_t ne = (nb / j->bn + 1) * j->bn < n1 ? (nb / j->bn + 1) * j->bn : n1;
            convert_row(tb + c * stride + (nb - n0), j->out + (k0 + c) * j->out_stride + nb, ne - nb, &tabs[q]);
            nb = ne;
        }
    }
}

/* Work unit t.  Not transposed: ROWS source rows, each end to end (long streams in and out).
   Transposed: a band of BAND source columns (= BAND output rows) by SPAN source rows; the
   codes are transposed into the worker's scratch tb in 8x8 blocks, then each output row is
   converted in segments of one scale block.  Measured on a 2-core Xeon: output rows written
   SPAN codes at a time are what makes this fast (the strided writes are the cost). */
static void do_unit(job_t *j, int64_t t, uint8_t *tb, tables_t *tabs) {
    tables_t tab;
    if (!j->transposed) {
        int64_t r0 = t * ROWS, r1 = r0 + ROWS < j->n ? r0 + ROWS : j->n;
        while (r0 < r1) { /* rows of one scale block row; one table per column block */
            int64_t br = r0 / j->bn, re = (br + 1) * j->bn < r1 ? (br + 1) * j->bn : r1;
            for (int64_t k0 = 0; k0 < j->k; k0 += j->bk) {
                int64_t k1 = k0 + j->bk < j->k ? k0 + j->bk : j->k;
                make_tables(&tab, j->scale[br * j->ss0 + (k0 / j->bk) * j->ss1], j->nan_bits);
                for (int64_t r = r0; r < re; r++)
                    convert_row(j->src + r * j->src_stride + k0, j->out + r * j->out_stride + k0, k1 - k0, &tab);
            }
            r0 = re;
        }
        return;
    }
    int64_t band = t / j->spans, span = t % j->spans;
    int64_t bc = band / j->sub_k;
    int64_t k0 = bc * j->bk + (band % j->sub_k) * BAND, k1 = k0 + BAND;
    if (k1 > (bc + 1) * j->bk) k1 = (bc + 1) * j->bk;
    if (k1 > j->k) k1 = j->k;
    int64_t n0 = span * SPAN, n1 = n0 + SPAN < j->n ? n0 + SPAN : j->n;
    if (k0 >= k1 || n0 >= n1) return;
    int64_t tk = k1 - k0, tn = n1 - n0;
    /* tb[c * stride + a] = code (n0 + a, k0 + c); a constant stride (full spans) measured ~25% faster */
    if (tn == SPAN) transposed_unit(j, tb, tabs, SPAN, n0, n1, k0, bc, tk);
    else transposed_unit(j, tb, tabs, tn, n0, n1, k0, bc, tk);
}

typedef struct { job_t *j; uint8_t *tb; tables_t *tabs; } worker_t;

static void *worker(void *arg) {
    worker_t *w = (worker_t *)arg;
    for (;;) {
        int64_t t = __atomic_fetch_add(&w->j->next, 1, __ATOMIC_RELAXED);
        if (t >= w->j->nunits) return NULL;
        do_unit(w->j, t, w->tb, w->tabs);
    }
}

int d3_fp8_simd_level(void) {
#if defined(__AVX2__)
    return 2;
#elif defined(__SSE4_1__)
    return 1;
#else
    return 0;
#endif
}

/* Expand one (n, k) block-FP8 weight.  Returns the number of threads that worked (>= 1). */
int d3_fp8_expand(const uint8_t *src, int64_t n, int64_t k, int64_t src_stride,
                  const float *scale, int64_t ss0, int64_t ss1,
                  uint16_t *out, int64_t out_stride, int64_t bn, int64_t bk,
                  int transposed, int nan_bits, int threads) {
    job_t j;
    memset(&j, 0, sizeof j);
    j.src = src; j.n = n; j.k = k; j.src_stride = src_stride;
    j.scale = scale; j.ss0 = ss0; j.ss1 = ss1;
    j.out = out; j.out_stride = out_stride; j.bn = bn; j.bk = bk;
    j.transposed = transposed; j.nan_bits = (uint16_t)nan_bits;
    j.sub_k = (bk + BAND - 1) / BAND;
    j.spans = (n + SPAN - 1) / SPAN;
    j.nunits = transposed ? ((k + bk - 1) / bk) * j.sub_k * j.spans : (n + ROWS - 1) / ROWS;
    if (j.nunits == 0) return 1;
    /* Scratch: one transposed unit and its tables per worker; workers are capped so that all of
       it stays within n * k bytes (half the expert's bfloat16 size). */
    int64_t tb_size = transposed ? (k < BAND ? k : BAND) * (n < SPAN ? n : SPAN) : 0;
    int64_t segments = transposed ? (n < SPAN ? n : SPAN) / bn + 2 : 0; /* scale blocks a unit meets */
    int64_t scratch = tb_size + segments * (int64_t)sizeof(tables_t);
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > j.nunits) threads = (int)j.nunits;
    if (scratch && threads > n * k / scratch) threads = (int)(n * k / scratch);
    if (threads < 1) threads = 1;
    pthread_t th[MAX_THREADS];
    worker_t w[MAX_THREADS];
    int ready = 0;
    for (; ready < threads; ready++) {
        w[ready].j = &j;
        void *mem = NULL;
        if (scratch && posix_memalign(&mem, 64, (size_t)(scratch + 64)) != 0) break;
        w[ready].tb = (uint8_t *)mem; /* tb first, cache-line aligned; the tables after it */
        w[ready].tabs = mem ? (tables_t *)((uint8_t *)mem + ((tb_size + 63) & ~(int64_t)63)) : NULL;
    }
    if (ready == 0) return -1;
    int started = 0;
    for (int i = 1; i < ready; i++)
        if (pthread_create(&th[started], NULL, worker, &w[i]) == 0) started++;
    worker(&w[0]);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    /* A worker whose thread did not start left its units to the others: none is lost. */
    for (int i = 0; i < ready; i++) free(w[i].tb);
    return started + 1;
}
"""

_LOCK = threading.Lock()
_STATE: dict = {}  # "lib", "nan_bits", "reason", "path"


def _new_lock_in_child() -> None:
    # A fork while another thread builds would leave the child's copy of the lock held forever.
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)

# Where the built kernel is cached (README's environment table).
CACHE_DIR_ENV = "DRAMA3_PATCHES_CACHE_DIR"
# Generous for a one-second build on a loaded host; a hung compiler must not hang the server.
COMPILE_TIMEOUT_S = 300
VERSION_TIMEOUT_S = 30
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UnsafeCache(OSError):
    """A cache folder or library another user could have written: never loaded."""


def _cache_dir() -> tuple[Path, bool]:
    """The cache folder, and whether $DRAMA3_PATCHES_CACHE_DIR named it."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit), True
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "drama3_patches", False


def _check_private(st: os.stat_result, what: str) -> None:
    """Refuse what this user does not own or what others may write (UnsafeCache naming which)."""
    if st.st_uid != os.geteuid():
        raise UnsafeCache(f"{what} belongs to uid {st.st_uid}, not to this process (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise UnsafeCache(f"{what} is writable by group or others (mode {st.st_mode & 0o7777:04o})")


def _open_private_dir(path: Path) -> int:
    """An fd of ``path`` (created 0700 when absent) after checking it is private to this user.

    Everything after works relative to this fd, so renaming the path afterwards (by
    whoever can write its parent) cannot put another folder under us.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(path.parent, exist_ok=True)
        os.mkdir(path, 0o700)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
    try:
        _check_private(os.fstat(fd), f"cache folder {path}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_library(name: str, dir_fd: int) -> int | None:
    """An fd of the library ``name`` in the folder, checked; None when absent; UnsafeCache when refused."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symbolic link stands there
        raise UnsafeCache(f"library {name} cannot be opened without following a link: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCache(f"library {name} is not a regular file")
        _check_private(st, f"library {name}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand.split()[0]):
            return cand
    return None


def _cpu_signature() -> str:
    # -march=native code must not run on another CPU: the cache key includes its features.
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _flags(native: bool) -> list[str]:
    flags = ["-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math"]
    if native:
        flags.append("-mcpu=native" if platform.machine() in ("aarch64", "arm64") else "-march=native")
    return flags


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(argv[:2])} ... did not finish within {timeout:.0f} s") from None


def _compile(cc: str, flags: list[str], dir_fd: int, name: str, where: Path) -> subprocess.CompletedProcess:
    """Compile into a fresh private folder inside ``where``, then rename the library into the folder.

    The rename is atomic: concurrent builders (several ranks) never see half a file.
    """
    tmp = tempfile.mkdtemp(prefix=".build-", dir=where)  # 0700, a name nobody could guess
    try:
        src = os.path.join(tmp, "fp8_expand.c")
        with open(src, "w") as f:
            f.write(SOURCE)
        out = os.path.join(tmp, name)
        proc = _run([*cc.split(), *flags, "-o", out, src], COMPILE_TIMEOUT_S)
        if proc.returncode == 0:
            tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
            try:
                _check_private(os.fstat(tmp_fd), f"build folder {tmp}")
                os.replace(name, name, src_dir_fd=tmp_fd, dst_dir_fd=dir_fd)
            finally:
                os.close(tmp_fd)
        return proc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Library:
    """A checked library: its path (for messages) and an open fd of exactly the file checked."""

    def __init__(self, path: Path, fd: int, temporary: str | None = None):
        self.path, self.fd, self.temporary = path, fd, temporary

    def load_path(self) -> str:
        # dlopen() by name would resolve the path again, after the checks, through folders
        # someone else may be able to rename: /proc/self/fd/N names the very inode checked,
        # so what is loaded is what was checked (the swap-after-check race is closed).
        proc = f"/proc/self/fd/{self.fd}"
        return proc if os.path.exists(proc) else str(self.path)

    def close(self) -> None:
        os.close(self.fd)
        if self.temporary:
            shutil.rmtree(self.temporary, ignore_errors=True)  # a loaded library stays mapped


def _find_or_build(extra_flags: tuple[str, ...], cache_dir: Path | None, rebuild: bool) -> _Library:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    version = _run([*cc.split(), "--version"], VERSION_TIMEOUT_S).stdout
    explicit = cache_dir is not None
    if cache_dir is None:
        cache_dir, explicit = _cache_dir()
    try:
        dir_fd = _open_private_dir(cache_dir)
        try:
            return _in_folder(cc, version, extra_flags, cache_dir, dir_fd, rebuild)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        # Not ours, open to others, a link or FIFO planted, or not writable (a read-only
        # home): build where nobody else can write, for this process only, and say why.
        why = f"{exc}" if isinstance(exc, UnsafeCache) else f"cache folder {cache_dir}: {exc}"
        how = f"{CACHE_DIR_ENV}={cache_dir} is refused" if explicit else "the kernel cache is not used"
        logger.warning("fp8 expansion: %s (%s); building in a private temporary folder instead "
                       "(fix: a folder of this user, mode 700%s)", how, why,
                       "" if explicit else f", or set {CACHE_DIR_ENV}")
    temporary = Path(tempfile.mkdtemp(prefix="drama3_patches-"))  # 0700, unpredictable name
    try:
        dir_fd = os.open(temporary, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
        try:
            lib = _in_folder(cc, version, extra_flags, temporary, dir_fd, rebuild=False)
        finally:
            os.close(dir_fd)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    lib.temporary = str(temporary)
    return lib


def _in_folder(cc: str, version: str, extra_flags: tuple[str, ...], folder: Path, dir_fd: int,
               rebuild: bool) -> _Library:
    """The checked library in a checked folder: found there, or compiled into it."""
    errors = []
    for native in (True, False):
        flags = _flags(native) + list(extra_flags)
        key = hashlib.sha256("\0".join([SOURCE, cc, version, *flags, platform.machine(),
                                        _cpu_signature()]).encode()).hexdigest()[:16]
        name = f"fp8_expand-{key}.so"
        if rebuild:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
        fd = _open_library(name, dir_fd)
        if fd is None:
            proc = _compile(cc, flags, dir_fd, name, folder)
            if proc.returncode != 0:
                errors.append(f"{cc} {' '.join(flags)}: {proc.stderr.strip()[-2000:]}")
                continue
            fd = _open_library(name, dir_fd)
            if fd is None:
                raise RuntimeError(f"the built library {name} vanished from {folder}")
        return _Library(folder / name, fd)
    raise RuntimeError("building the fp8 kernel failed: " + " | ".join(errors))


def build(extra_flags: tuple[str, ...] = (), cache_dir: Path | None = None, rebuild: bool = False) -> Path:
    """Compile the kernel (or find it in the cache) and return the checked library's path; raises on failure.

    For tests and tools that load it themselves; :func:`load` keeps the checked file open instead.
    """
    lib = _find_or_build(extra_flags, cache_dir, rebuild)
    lib.temporary = None  # the caller loads it by path: keep it
    lib.close()
    return lib.path


def _open(path) -> ctypes.CDLL:
    """Load a library file (a path, or a checked :class:`_Library`) and declare its functions."""
    lib = ctypes.CDLL(path.load_path() if isinstance(path, _Library) else str(path))
    i64 = ctypes.c_int64
    fn = lib.d3_fp8_expand
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, i64, i64, i64, ctypes.c_void_p, i64, i64, ctypes.c_void_p, i64, i64, i64,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.d3_fp8_simd_level.restype = ctypes.c_int
    return lib


def _open_checked(extra_flags: tuple[str, ...] = ()):
    """Find or build, check and load; a cached library that does not load (truncated) is rebuilt once."""
    lib = _find_or_build(extra_flags, None, rebuild=False)
    try:
        try:
            return _open(lib), lib.path
        except (OSError, AttributeError) as exc:  # not a loadable object, or a symbol missing
            logger.warning("fp8 expansion: the cached kernel %s does not load (%s); building it again",
                           lib.path, exc)
    finally:
        lib.close()
    lib = _find_or_build(extra_flags, None, rebuild=True)
    try:
        return _open(lib), lib.path
    finally:
        lib.close()


def torch_nan_bits() -> int | None:
    """The bfloat16 bits torch's contiguous float32 -> bfloat16 conversion gives NaN (None if not one value)."""
    pats = torch.tensor([0x7FC00000, -0x400000, 0x7F800001, -1, 0x7FFFFFFF, 0x7FA00000], dtype=torch.int64)
    seen = set()
    for n in (1, 7, 33, 257):
        for p in pats.tolist():
            t = torch.full((n,), p, dtype=torch.int64).to(torch.int32).view(torch.float32)
            seen.update((t.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF).tolist())
    return seen.pop() if len(seen) == 1 else None


def _self_check(lib, nan_bits: int) -> str | None:
    """Compare with the definition on all codes, scale extremes and both layouts; a reason on mismatch."""
    g = torch.Generator().manual_seed(0)
    for n, k in ((130, 300), (256, 256), (7, 129)):
        codes = torch.randint(0, 256, (n * k,), dtype=torch.uint8, generator=g)
        codes[:256] = torch.arange(256, dtype=torch.uint8)
        w = codes.view(n, k).view(torch.float8_e4m3fn)
        for mag in (1e-2, -3.0, 1e-37, 2.0 ** 119, 0.0):
            s = torch.rand(expected_scale_shape((n, k)), generator=g) * mag + mag / 8
            if s.numel() > 2:
                s.view(-1)[1] = float("inf")
                s.view(-1)[2] = float("nan")
            ref = reference_dequant(w, s)
            for transposed in (False, True):
                out = torch.empty((k, n) if transposed else (n, k), dtype=torch.bfloat16)
                _call(lib, w.view(torch.uint8), s, out, transposed, (128, 128), 2, nan_bits)
                want = ref.t().contiguous() if transposed else ref
                if not torch.equal(out.view(torch.int16), want.view(torch.int16)):
                    return f"self-check mismatch (shape {(n, k)}, scale {mag}, transposed={transposed})"
    return None


def _call(lib, codes, scale32, out, transposed: bool, block_size, threads: int, nan_bits: int) -> int:
    """One C call; returns how many threads worked (the kernel caps them to bound its scratch)."""
    n, k = codes.shape
    used = lib.d3_fp8_expand(codes.data_ptr(), n, k, codes.stride(0), scale32.data_ptr(), scale32.stride(0),
                      scale32.stride(1), out.data_ptr(), out.stride(0), int(block_size[0]), int(block_size[1]),
                      int(transposed), nan_bits, max(1, int(threads)))
    if used < 1:
        raise MemoryError("fp8 native kernel: no scratch memory for a worker")
    return used


def load():
    """The loaded, self-checked library, or None (the reason is in :func:`unavailable_reason`)."""
    if "lib" in _STATE:
        return _STATE["lib"]
    with _LOCK:
        if "lib" in _STATE:
            return _STATE["lib"]
        lib, reason = None, None
        try:
            nan_bits = torch_nan_bits()
            if nan_bits is None:
                reason = "torch's float32 -> bfloat16 conversion gives NaN more than one encoding"
            else:
                candidate, path = _open_checked()
                reason = _self_check(candidate, nan_bits)
                if reason is None:
                    lib = candidate
                    _STATE.update(nan_bits=nan_bits, path=path, simd=candidate.d3_fp8_simd_level())
        except Exception as exc:  # no compiler, build error, unwritable cache: the torch path still works
            reason = f"{type(exc).__name__}: {exc}"
        if lib is None:
            logger.warning("fp8 expansion: native kernel unavailable (%s); using the torch-op path", reason)
        _STATE["reason"] = reason
        _STATE["lib"] = lib
        return lib


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    load()
    return _STATE.get("reason")


def info() -> dict:
    """What was loaded: library path, SIMD level (2 AVX2, 1 SSE4.1, 0 scalar table), NaN bits."""
    load()
    return {k: _STATE.get(k) for k in ("path", "simd", "nan_bits", "reason")}


def expand(codes, scale32, out, *, transposed: bool, block_size, threads: int) -> int:
    """``out`` <- expansion of ``codes`` (2-D uint8 view of the fp8 weight, unit column stride).

    ``scale32`` is a 2-D float32 CPU tensor, ``out`` a CPU bfloat16 tensor of shape ``(k, n)``
    (transposed) or ``(n, k)`` with unit column stride.  Callers check shapes.  Returns the
    number of threads that worked.
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"fp8 native kernel unavailable: {_STATE.get('reason')}")
    return _call(lib, codes, scale32, out, transposed, block_size, threads, _STATE["nan_bits"])
