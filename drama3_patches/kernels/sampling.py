"""Drama 3's frame draw: the eager counterpart of ``fish_omni.kernels.draw_top_k_top_p``.

This is not vLLM's sampler.  Per row, with ``t = max(temperature, min_temperature)``:

* ``p_r = exp(v_r / t - max(logits / t)) / sum(exp(logits / t - max))`` for the
  ``max_top_k`` largest logits ``v_r`` (rank ``r``): probabilities over the
  whole row, never renormalised over the candidates;
* rank ``r`` is kept when ``cumsum(p)_r <= top_p`` (inclusive) and
  ``r < top_k``, and rank 0 always;
* the winner is the kept rank with the largest ``p_r / -log(max(u_r, 1e-30))``
  (an exponential race on the caller's uniform noise ``u``; the first rank on
  a tie), so a given ``uniform`` fixes the token;
* its column index, mapped through ``id_map`` when given, is returned.

Everything after the one ``topk`` runs on ``[rows, max_top_k]`` tensors
except the normaliser, which reads the full row once: no sort of the vocabulary,
no host synchronisation.

Few launches, the same values as the plain form: the row maximum of
``logits / t`` is ``values[:, 0] / t`` (division by ``t > 0`` is monotonic in
floating point, and ``topk`` puts the row's maximum first); the candidates'
``exp(v / t - max)`` are gathered from the full row's (the same elementwise
arithmetic on the same values); the race is run as
``argmin(p / log u)`` (``p / -log u`` negated exactly, and ``argmin`` takes the
first minimum as ``argmax`` takes the first maximum); rank 0 needs no forcing:
the cumulative sum never decreases, so when rank 0 fails both tests every rank
does, every score is the fill value and ``argmin`` returns rank 0.  (The one
input where this differs from forcing it is noise exactly 1.0 on rank 0, which
``torch.rand`` never draws.)
"""

from __future__ import annotations

import torch

from .norms import constant, prepared

__all__ = ["draw_top_k_top_p"]

_NOISE_FLOOR = 1e-30  # -log(0) would be inf: the kernel floors u here


def draw_top_k_top_p(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
    max_top_k: int,
    id_map: torch.Tensor | None = None,
    top: tuple[torch.Tensor, torch.Tensor] | None = None,
    min_temperature: float = 1e-5,
) -> torch.Tensor:
    """One int64 token per row of ``logits`` ``[rows, vocab]``.

    ``temperature``, ``top_k``, ``top_p``: one value per row.  ``uniform``:
    ``[rows, >= max_top_k]`` U(0, 1) noise (the first ``max_top_k`` columns
    are read).  ``top``: a ``torch.topk(logits, max_top_k)`` result to reuse
    (several draws over the same logits share it; its values must be those
    logits' own, as the candidates' probabilities are read from the row).  ``id_map``: column index ->
    token id.  Probabilities are float32 whatever the logits' dtype.
    """
    rows = logits.shape[0]
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if top is None:
        top = torch.topk(logits, max_top_k, dim=-1)
    values, ids = top
    values, ids = values[:, :max_top_k], ids[:, :max_top_k]

    t = temperature.reshape(rows, 1).to(torch.float32).clamp_min(min_temperature)
    # bfloat16 / float16 logits promote to float32 inside the divisions
    row_max = torch.div(values[:, :1], t)
    weights = torch.div(logits, t).sub_(row_max).exp_()
    # the candidates' exp(v / t - max) are the row's own at their columns
    probs = weights.gather(1, ids).div_(weights.sum(dim=-1, keepdim=True))
    ranks = _ranks(max_top_k, logits.device)
    keep = (probs.cumsum(dim=-1) <= top_p.reshape(rows, 1)) & (ranks < top_k.reshape(rows, 1))
    log_u = uniform[:, :max_top_k].to(torch.float32).clamp_min(_NOISE_FLOOR).log_()
    score = torch.where(keep, probs.div_(log_u), constant(1.0, logits.device))
    token = ids.gather(1, score.argmin(dim=-1, keepdim=True)).squeeze(1)
    if id_map is not None:
        token = id_map[token]
    return token.to(torch.int64)


def _ranks(max_top_k: int, device) -> torch.Tensor:
    return prepared(("ranks", max_top_k, str(device)), (), lambda: torch.arange(max_top_k, device=device))
