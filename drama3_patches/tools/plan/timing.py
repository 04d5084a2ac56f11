"""``plan --time``: stage 0's time per frame and stage 1's per second of audio, from launches and bytes.

A frame is 2,048 samples at 44.1 kHz (46.4 ms of audio); a stream keeps up while its frames come
out faster. Stage 0 makes one frame per request per decode step, so its step time at a batch of
``n`` is the frame time of each of ``n`` streams. The step is split into:

- ``host_dispatch``: launches x the host's cost per launch, plus graph replays x the cost per
  replay. Launches per component come from the real engine (:mod:`.launch_table`); a graph path
  replaces what it captures by replays.
- ``weights``: the dense weights each card reads once per step (backbone after sharding, without
  the embedding table, which is gathered a row per token; the kept lm_head rows).
- ``experts``: the routed experts' bytes times the expected share of them a batch routes to:
  with ``E`` experts and top-``k`` routing, each of ``n`` tokens picks ``k``, so an expert is
  used with probability ``1 - (1 - k/E)^n`` (routing taken as uniform). With EP a card holds
  ``ceil(E/tp)`` whole experts, without it a ``1/tp`` slice of each: either way the card reads
  that share of its resident expert bytes.
- ``tower``: the codebook tower's weights (per card, after the TP split), read once per step;
  its code tables and embeddings are gathered, not read whole.
- ``kv``: each sequence's full-attention KV over its context, the tower's KV over one frame's
  codes, and the gated-delta-net state (read and written back).
- ``collectives``: TP all-reduces (two per backbone layer, one per split tower layer) of
  ``n x hidden`` bfloat16 values: ``latency + 2 (tp-1)/tp x bytes / link``. With EP across the
  TP group every rank sees the same tokens and the MoE output is combined by that same
  all-reduce, so EP adds no exchange of its own.
- ``dac``: stage 1's device time for the audio the step made, where it shares a card with a
  stage-0 rank (the shipped profiles put it there).

Each device term is a roofline: the larger of its bytes over HBM bandwidth and its FLOPs over the
card's throughput. **Step rule: step = max(host, device).** In eager mode the host enqueues
launches on the device's stream and returns, so host dispatch and device work overlap within a
step; the step waits for the slower of the two. The host syncs a step makes are all in the
runner at its start (``benchmarks/dispatch.py``: 7 per frame, none in the forward), where the
previous step's output is read, so they serialise steps, not the work inside one.

Stage 1, the DAC decoder, is timed per second of audio from ``codec.pth``'s shapes: each
convolution's or matrix's FLOPs at the rate of its input (the published DAC's layout: codes at
the frame rate, the quantizer's post transformer there, its two transposed convolutions each
multiplying the rate by their kernel, then the decoder's input convolution and four blocks whose
transposed convolution (kernel twice its stride) multiplies it by half its kernel), each chunk
decoded with its left context. Audio s/s is bounded by the slower stage.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from drama3_patches.tools.plan import launch_table
from drama3_patches.tools.plan.model import (BACKBONE_PREFIX, DAC_ENCODER_ONLY, FISH_OMNI, WEIGHT_NORM_MAGNITUDE,
                                            PlanError, _dense_fraction, _role, model_shape)

SAMPLE_RATE = 44100
FRAME_SAMPLES = 2048
FRAME_MS = 1000.0 * FRAME_SAMPLES / SAMPLE_RATE  # 46.44 ms of audio per frame
FRAME_RATE = SAMPLE_RATE / FRAME_SAMPLES
GRAPHS = ("eager", "piecewise", "piecewise+tower")
DEVICE_TERMS = ("weights", "experts", "tower", "kv", "collectives", "dac")
COMPONENTS = ("host_dispatch",) + DEVICE_TERMS
# vllm-omni's snake(): alpha + eps, reciprocal, alpha * x, sin, pow, product, sum (read from its source).
SNAKE_LAUNCHES = 7
# Piecewise graphs split at each attention and GDN core op, which run outside the graphs. Their
# launches on the card are not counted here: taken as two each (the kernel and its cache write).
SPLIT_OP_LAUNCHES = 2
DAC_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Constants:
    """Card and host figures the time model computes with (cards.SPEEDS, or the options)."""
    hbm_gbps: float
    bf16_tflops: float
    fp32_tflops: float
    link_gbps: float
    link_latency_us: float
    launch_us: float
    replay_us: float


@dataclass(frozen=True)
class Workload:
    context_tokens: int = 512      # tokens each sequence attends over (prompt, reference codes, frames so far)
    dac_chunk_frames: int = 64     # the shipped profiles' codec_chunk_frames
    dac_left_context: int = 32     # codec_left_context_frames: decoded again with each chunk
    norms: str = "fused"           # the tower kernels' path: fused (torch-npu's fused norms) or eager


@dataclass
class Inputs:
    """What one stage-0 card reads and computes per step, from the checkpoint and the plan."""
    tp: int
    hidden: int
    num_layers: int
    dense_read: float            # bytes per step (backbone without the embedding, kept lm_head rows)
    expert_resident: float       # routed expert bytes on this card
    expert_elems_per_token: float  # expert weight elements one token's k experts touch (whole model)
    num_experts: int
    top_k: int
    tower_read: float
    tower_layers: int
    tower_split: bool
    kv_per_token: float          # backbone full-attention KV bytes per context token, this card
    tower_kv_per_frame: float    # the tower's KV bytes over one frame's codes, this card
    state_per_seq: float         # gated-delta-net state bytes, this card
    dac: dict | None = None      # dac_time() figures, or None without codec.pth


def experts_used_share(n: int, k: int, e: int) -> float:
    """Expected share of ``e`` experts that ``n`` tokens routing top-``k`` each (uniformly) touch."""
    if e <= 0 or k <= 0 or n <= 0:
        return 0.0
    return 1.0 - (1.0 - min(k, e) / e) ** n


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


_Q_UP = re.compile(r"^quantizer\.upsample\.(\d+)\.0\.")
_DEC_UP = re.compile(r"^decoder\.model\.(\d+)\.block\.1\.")
_DAC_ORDER = ("quantizer.post_module.", "quantizer.upsample.", "decoder.")
_WEIGHTS = (".weight", ".weight_v", ".original1")


def dac_time(codec: dict, dtype: str) -> dict | None:
    """Stage 1's work per second of audio from codec.pth's decoder-side shapes: FLOPs, weight and
    activation bytes, and launches per decoded chunk. None when no convolution is found."""
    size = DAC_DTYPE_BYTES[dtype]
    tensors = [t for t in codec.values() if t.name.startswith(_DAC_ORDER) and not t.name.startswith(DAC_ENCODER_ONLY)
               and not WEIGHT_NORM_MAGNITUDE.search(t.name)]
    tensors.sort(key=lambda t: (next(i for i, p in enumerate(_DAC_ORDER) if t.name.startswith(p)), _natural(t.name)))
    rate = FRAME_RATE
    flops = act_bytes = weight_bytes = 0.0
    launches = convs = 0
    for t in tensors:
        weight_bytes += t.numel * size
        if t.name.endswith("alpha"):      # a Snake1d over (1, channels, 1)
            launches += SNAKE_LAUNCHES
            act_bytes += 2 * t.numel * rate * size * 2  # its input read, its output written (two passes)
            continue
        if len(t.shape) < 2 or not t.name.endswith(_WEIGHTS):
            continue  # biases, norms, buffers (rotary tables, masks)
        launches += 1
        convs += len(t.shape) == 3
        flops += 2.0 * t.numel * rate
        q, d = _Q_UP.match(t.name), _DEC_UP.match(t.name)
        if len(t.shape) == 3 and (q or d):  # transposed conv (in, out, kernel): raises the rate
            stride = t.shape[2] if q else t.shape[2] // 2
            act_bytes += (t.shape[0] * rate + t.shape[1] * rate * stride) * size
            rate *= stride
        else:
            inward = t.shape[0] if len(t.shape) == 3 and t.shape[1] == 1 else t.shape[1]  # depthwise: groups
            act_bytes += (inward + t.shape[0]) * rate * size
    if not convs:
        return None
    return {"flops_per_audio_s": flops, "activation_bytes_per_audio_s": act_bytes, "weight_bytes": weight_bytes,
            "launches_per_chunk": launches, "output_rate": rate, "dtype": dtype}


def _top_k(ckpt) -> int:
    k = ckpt.text_config.get("num_experts_per_tok")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PlanError("config.json: --time needs num_experts_per_tok (the experts each token routes to)")
    return k


def step_inputs(ckpt, plan, sums: dict) -> Inputs:
    """Bytes, shapes and counts one stage-0 card works with per step, for :func:`frame_time`."""
    shape = model_shape(ckpt)
    tp = plan.options.tp
    f = plan.figures
    fish = ckpt.kind == FISH_OMNI
    dense = 0.0
    for t in ckpt.tensors.values():
        if _role(ckpt, t.name) != "backbone" or "embed_tokens" in t.name:
            continue
        dense += t.nbytes * _dense_fraction(t.name[len(BACKBONE_PREFIX):] if fish else t.name, t, shape, tp)
    dense += f.get("head", 0)
    tower_read = 0.0
    if fish and shape.tower:
        gathered = sum(t.nbytes for t in ckpt.tensors.values()
                       if _role(ckpt, t.name) == "tower" and "embedding" in t.name)
        tower_read = f["tower"] - gathered
    k = _top_k(ckpt) if shape.num_experts else 0
    per_expert = sums["expert_weight_elems"] / shape.num_experts if shape.num_experts else 0
    tower_kv = f.get("kv_per_token_tower", 0)
    codebooks = shape.tower.num_codebooks if shape.tower else 0
    dac = None
    if ckpt.codec is not None:
        dac = dac_time(ckpt.codec, plan.options.dac_dtype)
    return Inputs(
        tp=tp, hidden=shape.hidden_size, num_layers=shape.num_layers, dense_read=dense,
        expert_resident=f["experts_resident"], expert_elems_per_token=per_expert * k, num_experts=shape.num_experts,
        top_k=k, tower_read=tower_read, tower_layers=shape.tower.num_layers if shape.tower else 0,
        tower_split=bool(f.get("tower_split")), kv_per_token=f["kv_per_token"] - tower_kv,
        tower_kv_per_frame=tower_kv * codebooks, state_per_seq=f["state_per_seq"], dac=dac)


def host_launches(graph: str, n: int, inputs: Inputs, norms: str) -> tuple[float, int]:
    """(launches dispatched eagerly, graph replays) per step on ``graph``."""
    counts = launch_table.at_batch(norms, n)
    backbone = sum(counts[c] for c in launch_table.BACKBONE)
    tower = sum(counts[c] for c in launch_table.TOWER) + sum(counts[c] for c in launch_table.GLUE)
    outside = counts[launch_table.OUTSIDE_NAME]
    if graph == "eager":
        return backbone + tower + outside, 0
    # The backbone replayed between its attention and GDN core ops: a piece before each, one after.
    split = inputs.num_layers * SPLIT_OP_LAUNCHES
    replays = inputs.num_layers + 1
    if graph == "piecewise":
        return split + tower + outside, replays
    if graph == "piecewise+tower":
        return split + outside, replays + 1  # the tower, heads and sampler: one graph per batch bucket
    raise ValueError(graph)


def _roofline_ms(bytes_: float, flops: float, k: Constants, fp32: bool = False) -> float:
    rate = (k.fp32_tflops if fp32 else k.bf16_tflops) * 1e12
    return 1e3 * max(bytes_ / (k.hbm_gbps * 1e9), flops / rate if rate else 0.0)


def dac_ms_per_audio_s(dac: dict | None, k: Constants, wl: Workload) -> tuple[float, float]:
    """(device ms, host ms) stage 1 spends per second of audio, each chunk with its left context."""
    if not dac:
        return 0.0, 0.0
    redo = (wl.dac_chunk_frames + wl.dac_left_context) / wl.dac_chunk_frames
    chunks_per_s = FRAME_RATE / wl.dac_chunk_frames
    device = _roofline_ms(dac["activation_bytes_per_audio_s"] * redo + dac["weight_bytes"] * chunks_per_s,
                          dac["flops_per_audio_s"] * redo, k, fp32=dac["dtype"] == "float32")
    host = dac["launches_per_chunk"] * chunks_per_s * k.launch_us / 1e3
    return device, host


def frame_time(inputs: Inputs, n: int, graph: str, k: Constants, wl: Workload) -> dict:
    """One level: the step's components (ms), ms per frame, audio s/s, RTF and the bounding term."""
    tp, size = inputs.tp, 2
    launches, replays = host_launches(graph, n, inputs, wl.norms)
    host = (launches * k.launch_us + replays * k.replay_us) / 1e3
    share = experts_used_share(n, inputs.top_k, inputs.num_experts)
    comp = {
        "host_dispatch": host,
        "weights": _roofline_ms(inputs.dense_read, n * inputs.dense_read, k),  # 2 FLOPs per bf16 weight (2 bytes)
        "experts": _roofline_ms(inputs.expert_resident * share, 2.0 * n * inputs.expert_elems_per_token / tp, k),
        "tower": _roofline_ms(inputs.tower_read, n * inputs.tower_read, k),
        "kv": _roofline_ms(n * (wl.context_tokens * inputs.kv_per_token + inputs.tower_kv_per_frame
                                + 2 * inputs.state_per_seq), 0.0, k),
    }
    coll = 0.0
    if tp > 1:
        count = 2 * inputs.num_layers + (inputs.tower_layers if inputs.tower_split else 0)
        per = k.link_latency_us / 1e3 + 1e3 * 2 * (tp - 1) / tp * n * inputs.hidden * size / (k.link_gbps * 1e9)
        coll = count * per
    comp["collectives"] = coll
    dac_dev, dac_host = dac_ms_per_audio_s(inputs.dac, k, wl)
    comp["dac"] = dac_dev * n * FRAME_MS / 1e3  # the step's audio, decoded on the card it shares
    device = sum(comp[t] for t in DEVICE_TERMS)
    step = max(host, device)
    # Stage 1's own host process dispatches its launches: the frame time it allows n streams.
    stage1 = n * FRAME_MS * dac_host / 1e3
    per_frame = max(step, stage1)
    audio = n * FRAME_MS / per_frame if per_frame > 0 else math.inf
    if stage1 > step:
        bound = "dac host dispatch (stage 1)"
    elif host >= device:
        bound = "host_dispatch"
    else:
        bound = max(DEVICE_TERMS, key=lambda t: comp[t])
    return {"concurrency": n, "graph": graph, "ms_per_frame": per_frame, "step_ms": step,
            "host_ms": host, "device_ms": device, "audio_s_per_s": audio, "rtf": n / audio,
            "bound": bound, "launches": launches, "replays": replays, "components_ms": comp}


def realtime_streams(inputs: Inputs, graph: str, k: Constants, wl: Workload, limit: int = 1024) -> int:
    """The largest concurrency whose frame time stays within 46.4 ms (0 when none does). Frame time
    never falls as concurrency grows, so the search stops at the first level over."""
    best = 0
    for n in range(1, limit + 1):
        if frame_time(inputs, n, graph, k, wl)["ms_per_frame"] > FRAME_MS:
            break
        best = n
    return best
