"""Top-k / top-p filtering and sampling without sorting the vocabulary.

Semantics are those of vLLM's v1 sampler (``apply_top_k_top_p_pytorch``
followed by ``random_sample``):

* top-k keeps every token whose logit is ``>=`` the k-th largest, so ties at
  the boundary are all kept; ``k <= 0`` or ``k >= vocab`` disables top-k for
  that row;
* top-p then keeps, in descending order, each token whose probability mass
  *above and including the smaller ones* exceeds ``1 - p`` (the reference's
  ascending cumulative sum), always at least the most likely token; the
  probabilities are renormalised over the top-k set first; ``p >= 1``
  disables top-p for that row;
* the sample is drawn from the softmax over the kept set (exponential race,
  as ``random_sample`` does); temperature ``0`` means greedy (argmax).

How it is fast on a CPU or an NPU without Triton: rows with top-k take one
``topk(max_k + 1)`` (the extra slot detects ties that straddle the boundary)
and do everything else on ``[batch, k]`` tensors; no full-vocabulary
probabilities are materialised.  Rows with only top-p first try a window of
the most likely tokens (one ``logsumexp`` over the vocabulary tells whether
the window already holds mass ``p``); only rows where it does not are sorted.

Host syncs: ``max(k)`` (topk needs a Python int), whether a tie run reaches
the end of the window, and, for top-p-only rows, whether the window suffices.

Precision: logits of any float dtype; probabilities in float32; the top-p
window's normaliser and cumulative sum in float64 on CPU/CUDA and float32 on
devices without native float64 (Ascend).  A ``generator`` must live on the
logits' device, as for any torch random op.
"""

from __future__ import annotations

import torch

__all__ = [
    "sample_top_k_top_p",
    "top_k_top_p_filter",
    "top_k_top_p_kept",
]

# Width of the first top-p-only window; rows whose nucleus is wider are sorted.
_TOP_P_WINDOW = 256
# Margin over p (float32 cumulative-sum error over a 150k vocabulary is ~1e-6)
# before trusting that the window holds the whole nucleus.
_WINDOW_MARGIN = 1e-4


def _per_row(value, batch: int, device, dtype) -> torch.Tensor | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.to(device=device, dtype=dtype)
        return value.expand(batch).clone() if value.dim() == 0 else value.reshape(batch)
    return torch.full((batch,), value, device=device, dtype=dtype)


def _prepare(logits, top_k, top_p):
    batch, vocab = logits.shape
    k = _per_row(top_k, batch, logits.device, torch.long)
    if k is not None:
        k = torch.where((k <= 0) | (k >= vocab), vocab, k)
    p = _per_row(top_p, batch, logits.device, torch.float32)
    if p is not None:
        p = torch.where(p >= 1.0, torch.ones_like(p), p)
    return k, p


def _top_k_window(logits: torch.Tensor, k: torch.Tensor, shared_k: int | None):
    """``(values, ids, keep)`` for rows that all have ``k < vocab``.

    ``values``/``ids`` are ``[rows, W]`` sorted descending; ``keep`` marks the
    top-k set including every tie of the k-th value.
    """
    vocab = logits.shape[1]
    kmax = shared_k if shared_k is not None else int(k.max())
    width = min(kmax + 1, vocab)
    values, ids = logits.topk(width, dim=-1)
    thresh = values.gather(1, (k - 1).unsqueeze(1))
    keep = values >= thresh
    if width < vocab and bool(keep[:, -1].any()):
        # A tie run reaches the last slot and may continue past it: widen.
        width = int((logits >= thresh).sum(dim=-1).max())
        values, ids = logits.topk(width, dim=-1)
        keep = values >= thresh
    return values, ids, keep


def _apply_top_p_reference_order(logits32: torch.Tensor, keep: torch.Tensor, p: torch.Tensor):
    """Top-p on a descending ``[rows, W]`` set, renormalised over ``keep``.

    Mirrors the reference's float32 ascending cumulative sum so the kept set
    matches it bit for bit whenever the probabilities do.
    """
    masked = logits32.masked_fill(~keep, float("-inf"))
    probs = masked.softmax(dim=-1)
    ascending = probs.flip(-1).cumsum(dim=-1).flip(-1)
    top_p = ascending > (1 - p).unsqueeze(1)
    top_p[:, 0] = True
    return keep & top_p


def _scaled(values: torch.Tensor, inv_temp: torch.Tensor | None) -> torch.Tensor:
    values = values.to(torch.float32)
    return values if inv_temp is None else values * inv_temp.unsqueeze(1)


def _acc_dtype(device: torch.device) -> torch.dtype:
    """Accumulation dtype of the top-p window: float64 where it is native.

    Ascend AI cores have no float64 arithmetic, so other devices accumulate in
    float32; there a token whose mass-before is within ~1e-6 of p may flip,
    which moves the sampled distribution by about that much.
    """
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def _logsumexp_acc(logits: torch.Tensor, inv_temp: torch.Tensor | None, acc: torch.dtype):
    """Row ``logsumexp`` of the scaled logits, ``[rows, 1]`` in ``acc``.

    Exponentials in float32, their sum in ``acc``: a float32 sum over a 150k
    vocabulary is off by ~1e-6, enough to move a top-p boundary.
    """
    full = logits.to(torch.float32)
    if inv_temp is not None:
        full = full * inv_temp.unsqueeze(1)
    top = full.amax(dim=-1, keepdim=True)
    total = (full - top).exp_().sum(dim=-1, keepdim=True, dtype=acc)
    return top.to(acc) + total.log()


def _top_p_only(logits: torch.Tensor, p: torch.Tensor, inv_temp: torch.Tensor | None):
    """``(ids, logits32, keep)`` for rows with only top-p (``p < 1``).

    A window of the most likely tokens decides the rows whose nucleus it
    holds; the other rows are sorted (the reference's method).
    """
    rows, vocab = logits.shape
    width = min(_TOP_P_WINDOW, vocab)
    acc = _acc_dtype(logits.device)
    values, ids = logits.topk(width, dim=-1)
    values = _scaled(values, inv_temp)
    if width < vocab:
        lse = _logsumexp_acc(logits, inv_temp, acc)
        probs = (values.to(acc) - lse).exp()
        wide = probs.sum(dim=-1) < p.to(acc) + _WINDOW_MARGIN
    else:
        probs = values.to(acc).softmax(dim=-1)
        wide = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    # Inside the window: keep token j while the mass before it is below p.
    before = probs.cumsum(dim=-1) - probs
    keep = before < p.to(acc).unsqueeze(1)
    keep[:, 0] = True
    if not bool(wide.any()):
        return ids, values, keep
    sel = wide.nonzero().squeeze(1)
    every = sel.numel() == rows
    # The reference's own method: ascending sort, float32 softmax and cumsum
    # in that order (a descending softmax differs by ulps that the cumsum
    # turns into ~1e-5 at the boundary).
    a_vals, a_ids = (logits if every else logits[sel]).sort(dim=-1)
    a_vals = _scaled(a_vals, None if inv_temp is None else inv_temp[sel])
    a_keep = a_vals.softmax(dim=-1).cumsum(dim=-1) > (1 - p[sel]).unsqueeze(1)
    a_keep[:, -1] = True
    # The kept set is a suffix of the ascending order: slice, then flip only that.
    n = int(a_keep.sum(dim=-1).max())
    s_vals, s_ids, s_keep = (t[:, vocab - n:].flip(-1) for t in (a_vals, a_ids, a_keep))
    if every:
        return s_ids, s_vals, s_keep
    out_w = max(width, n)
    out_ids = torch.zeros(rows, out_w, dtype=ids.dtype, device=ids.device)
    out_vals = torch.full((rows, out_w), float("-inf"), device=ids.device)
    out_keep = torch.zeros(rows, out_w, dtype=torch.bool, device=ids.device)
    out_ids[:, :width], out_vals[:, :width], out_keep[:, :width] = ids, values, keep
    merged_ids, merged_vals, merged_keep = out_ids[sel], out_vals[sel], out_keep[sel]
    merged_ids[:, :width], merged_keep[:, :width] = 0, False
    merged_ids[:, :n], merged_vals[:, :n], merged_keep[:, :n] = s_ids, s_vals, s_keep
    out_ids[sel], out_vals[sel], out_keep[sel] = merged_ids, merged_vals, merged_keep
    return out_ids, out_vals, out_keep


def _pad_cat(parts, rows: int, device):
    """Merge per-group ``(row_index, ids, logits32, keep)`` into one padded set."""
    width = max(part[1].shape[1] for part in parts)
    ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    vals = torch.full((rows, width), float("-inf"), device=device)
    keep = torch.zeros(rows, width, dtype=torch.bool, device=device)
    for index, g_ids, g_vals, g_keep in parts:
        w = g_ids.shape[1]
        ids[index, :w], vals[index, :w], keep[index, :w] = g_ids, g_vals, g_keep
    return ids, vals, keep


def _kept_groups(logits, k, p, inv_temp, shared_k, include_unfiltered: bool):
    """Split rows by what they need; return ``[(row_index, ids, logits32, keep)]``.

    Rows with neither filter are returned only with ``include_unfiltered``
    (as the whole vocabulary, sorted).
    """
    rows, vocab = logits.shape
    device = logits.device
    has_k = k < vocab if k is not None else torch.zeros(rows, dtype=torch.bool, device=device)
    has_p = p < 1.0 if p is not None else torch.zeros(rows, dtype=torch.bool, device=device)
    parts = []
    all_k = shared_k is not None and 0 < shared_k < vocab
    k_rows = torch.arange(rows, device=device) if all_k else has_k.nonzero().squeeze(1)
    if k_rows.numel():
        sub = logits if k_rows.numel() == rows else logits[k_rows]
        vals, ids, keep = _top_k_window(sub, k[k_rows], shared_k if all_k else None)
        g_inv = None if inv_temp is None else inv_temp[k_rows]
        vals32 = _scaled(vals, g_inv)
        if p is not None:
            g_p = p[k_rows]
            keep = torch.where(
                (g_p < 1.0).unsqueeze(1), _apply_top_p_reference_order(vals32, keep, g_p), keep
            )
        parts.append((k_rows, ids, vals32, keep))
    p_rows = (has_p & ~has_k).nonzero().squeeze(1)
    if p_rows.numel():
        sub = logits[p_rows]
        g_inv = None if inv_temp is None else inv_temp[p_rows]
        ids, vals32, keep = _top_p_only(sub, p[p_rows], g_inv)
        parts.append((p_rows, ids, vals32, keep))
    if include_unfiltered:
        rest = (~has_p & ~has_k).nonzero().squeeze(1)
        if rest.numel():
            vals, ids = logits[rest].sort(dim=-1, descending=True)
            g_inv = None if inv_temp is None else inv_temp[rest]
            parts.append((rest, ids, _scaled(vals, g_inv), torch.ones_like(ids, dtype=torch.bool)))
    return parts


def top_k_top_p_kept(
    logits: torch.Tensor,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The filtered distribution in compact form.

    ``logits`` is ``[B, V]`` (float32, bfloat16 or float16); ``top_k`` an int
    shared by the batch or a ``[B]`` integer tensor; ``top_p`` a float or a
    ``[B]`` tensor.  Returns ``(ids, probs)``, both ``[B, K]``: the kept
    vocabulary ids in descending logit order and their float32 probabilities
    (softmax over the kept set); padding has ``probs == 0``.  A row with no
    filter keeps the whole vocabulary.
    """
    rows, vocab = logits.shape
    if rows == 0:
        return (torch.zeros(0, 0, dtype=torch.long, device=logits.device),
                torch.zeros(0, 0, dtype=torch.float32, device=logits.device))
    k, p = _prepare(logits, top_k, top_p)
    shared_k = top_k if isinstance(top_k, int) else None
    parts = _kept_groups(logits, k, p, None, shared_k, include_unfiltered=True)
    ids, vals, keep = _pad_cat(parts, rows, logits.device)
    probs = vals.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    return ids, probs


def top_k_top_p_filter(
    logits: torch.Tensor,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Return a copy of ``[B, V]`` ``logits`` with filtered-out entries ``-inf``.

    Same kept set as vLLM's ``apply_top_k_top_p`` (see the module docstring);
    kept entries keep their original values and dtype.  The input is not
    modified.
    """
    rows, vocab = logits.shape
    k, p = _prepare(logits, top_k, top_p)
    if rows == 0 or (k is None and p is None):
        return logits.clone()
    shared_k = top_k if isinstance(top_k, int) else None
    out = logits.clone()
    for index, ids, _vals, keep in _kept_groups(logits, k, p, None, shared_k, False):
        # scatter_add: padding slots may repeat an id, and must not unmark it.
        counts = torch.zeros(index.numel(), vocab, dtype=torch.int32, device=logits.device)
        counts.scatter_add_(1, ids, keep.to(torch.int32))
        out[index] = out[index].masked_fill(counts == 0, float("-inf"))
    return out


def sample_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    temperature: torch.Tensor | float | None = None,
    generator: torch.Generator | None = None,
    id_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample one token per row.

    ``logits`` ``[B, V]`` (any float dtype; probabilities are computed in
    float32); ``top_k`` int (shared by the batch) or ``[B]``; ``top_p`` float
    or ``[B]``; ``temperature`` float or ``[B]``, ``0`` meaning greedy for that
    row (temperature divides the logits before top-p, as in vLLM's sampler).
    ``generator`` makes the draw reproducible; ``id_map`` (``[V]`` integer)
    maps the sampled index to the returned id (e.g. a codebook id).

    Returns ``[B]`` int64 (or ``id_map``'s dtype) ids.  The input is not
    modified.
    """
    rows, vocab = logits.shape
    device = logits.device
    out = torch.zeros(rows, dtype=torch.long, device=device)
    if rows:
        k, p = _prepare(logits, top_k, top_p)
        temp = _per_row(temperature, rows, device, torch.float32)
        greedy = None
        inv_temp = None
        if temp is not None:
            greedy = temp <= 0
            inv_temp = torch.where(greedy, torch.ones_like(temp), 1.0 / temp)
        shared_k = top_k if isinstance(top_k, int) else None
        parts = _kept_groups(logits, k, p, inv_temp, shared_k, include_unfiltered=False)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        for index, ids, vals, keep in parts:
            probs = vals.masked_fill(~keep, float("-inf")).softmax(dim=-1)
            out[index] = ids.gather(1, _race(probs, generator).unsqueeze(1)).squeeze(1)
            done[index] = True
        rest = (~done).nonzero().squeeze(1)
        if rest.numel():
            sub = logits[rest].to(torch.float32)
            if inv_temp is not None:
                sub = sub * inv_temp[rest].unsqueeze(1)
            out[rest] = _race(sub.softmax(dim=-1), generator)
        if greedy is not None and bool(greedy.any()):
            out = torch.where(greedy, logits.argmax(dim=-1), out)
    return out if id_map is None else id_map[out]


def _race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    # argmax(p / Exp(1)) draws index i with probability p_i (exponential race).
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return probs.div_(noise).argmax(dim=-1)
