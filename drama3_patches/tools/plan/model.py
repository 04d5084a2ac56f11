"""Per-card memory plan for a Drama 3 (Qwen3-Next-style MoE) checkpoint.

Reads ``config.json`` and the safetensors headers only (8-byte little-endian
length, then that many bytes of JSON); tensor data is never read, so a
checkpoint of any size is planned in milliseconds.

Model shape: Qwen3-Next ``config.json`` fields (hidden_size, layer_types or
full_attention_interval, linear_* for the gated-delta-net layers, num_experts,
moe_intermediate_size, ...). Linear-attention state per sequence follows vLLM's
``MambaStateShapeCalculator.gated_delta_net_state_shape``: a conv state of
``(2*nk*dk + nv*dv)/tp x (kernel-1)`` and a temporal state of
``(nv/tp) x dv x dk``, both in the model dtype (cache dtype ``auto``).

Sharding is an estimate of what vLLM does: 2-D+ dense tensors split by TP
(k/v projections by whole KV heads, replicated when there are fewer heads than
ranks), 1-D tensors and MoE routers replicated; routed experts split by TP
(intermediate dim) or, with EP, spread whole (``ceil(E/tp)`` per card).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field

from drama3_patches.tools.plan.cards import GIB, Card

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit

_EXPERT = re.compile(r"\.experts\.(\d+\.|w13_|w2_|gate_up_proj|down_proj)")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_SCALE = re.compile(r"(weight_scale_inv|weight_scale|_scale_inv|_scale)$")
_GATE_UP = re.compile(r"(gate_proj|up_proj|gate_up_proj|w13_|\.w1\.|\.w3\.)")


class PlanError(Exception):
    """Bad input; the message is one line an operator can act on."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def read_header(path: str) -> tuple[dict[str, Tensor], int]:
    """Tensors of one safetensors file from its header alone, and the bytes read."""
    name = os.path.basename(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise PlanError(f"{name}: too short to be a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise PlanError(f"{name}: header length {n} does not fit a {size}-byte file (not safetensors?)")
            raw = fh.read(n)
    except OSError as exc:
        raise PlanError(f"{name}: cannot read: {exc.strerror}") from None
    try:
        header = json.loads(raw)
    except ValueError:
        raise PlanError(f"{name}: header is not valid JSON (not a safetensors file?)") from None
    if not isinstance(header, dict):
        raise PlanError(f"{name}: header is not a JSON object")
    data_size = size - 8 - n
    tensors: dict[str, Tensor] = {}
    for tname, info in header.items():
        if tname == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise PlanError(f"{name}: tensor {tname!r} has a malformed header entry") from None
        if dtype not in DTYPE_BYTES:
            raise PlanError(f"{name}: tensor {tname!r} has dtype {dtype!r}, which plan does not know")
        t = Tensor(tname, dtype, shape, name)
        if end - begin != t.nbytes:
            raise PlanError(f"{name}: tensor {tname!r} spans {end - begin} bytes but {dtype}{list(shape)} "
                            f"needs {t.nbytes}")
        if end > data_size:
            raise PlanError(f"{name}: truncated: tensor {tname!r} ends at byte {end} of the data, "
                            f"the file holds {data_size}")
        tensors[tname] = t
    return tensors, 8 + n


@dataclass
class Checkpoint:
    path: str
    config: dict
    text_config: dict
    text_section: str
    files: list[str]
    tensors: dict[str, Tensor]
    header_bytes_read: int = 0


_PREFERRED = ("text_config", "llm_config", "language_config", "thinker_config", "slow_ar_config", "backbone_config")


def _text_config(config: dict, prefix: str = "") -> tuple[str, dict]:
    """(dotted key, dict) of the language model's fields: the top level, else a nested section."""
    if "num_hidden_layers" in config and "hidden_size" in config:
        return prefix or "(top level)", config
    keys = [k for k in _PREFERRED if isinstance(config.get(k), dict)]
    keys += [k for k, v in config.items() if isinstance(v, dict) and k not in keys]
    for key in keys:
        found = _text_config(config[key], f"{prefix}.{key}" if prefix else key)
        if found[1]:
            return found
    return "", {}


def _section(config: dict, dotted: str) -> dict:
    node = config
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        raise PlanError(f"config.json: no section {dotted!r}")
    return node


def load_checkpoint(path: str, section: str | None = None) -> Checkpoint:
    if not os.path.isdir(path):
        raise PlanError(f"{path}: not a directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise PlanError(f"{path}: no config.json")
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            config = json.load(fh)
    except ValueError as exc:
        raise PlanError(f"{cfg_path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise PlanError(f"{cfg_path}: not a JSON object")
    if section:
        where, text = section, _section(config, section)
        if "num_hidden_layers" not in text or "hidden_size" not in text:
            raise PlanError(f"config.json: section {section!r} has no num_hidden_layers and hidden_size")
    else:
        where, text = _text_config(config)
    if not text:
        raise PlanError(f"{cfg_path}: no language-model section with num_hidden_layers and hidden_size")

    index_path = os.path.join(path, INDEX_FILE)
    expected: dict[str, str] = {}
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as fh:
                expected = json.load(fh)["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise PlanError(f"{index_path}: not a valid index (needs a weight_map object)") from None
        files = sorted(set(expected.values()))
        for f in files:
            if not os.path.isfile(os.path.join(path, f)):
                tensor = next(t for t, v in expected.items() if v == f)
                raise PlanError(f"{INDEX_FILE} names shard {f} (for {tensor}), which is not in {path}")
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise PlanError(f"{path}: no *.safetensors files")

    tensors: dict[str, Tensor] = {}
    read = 0
    for f in files:
        part, nread = read_header(os.path.join(path, f))
        read += nread
        tensors.update(part)
    for tname, f in expected.items():
        if tname not in tensors:
            raise PlanError(f"{INDEX_FILE} places {tname} in {f}, whose header does not have it")
    return Checkpoint(path, config, text, where, files, tensors, read)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_full: int
    num_linear: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_nk: int
    linear_nv: int
    linear_dk: int
    linear_dv: int
    conv_kernel: int
    num_experts: int
    moe_intermediate: int
    block: tuple[int, int] | None
    dtype_bytes: int
    vocab_size: int


def model_shape(ckpt: Checkpoint) -> ModelShape:
    c = ckpt.text_config

    def need(key):
        if key not in c:
            raise PlanError(f"config.json: missing {key}")
        return c[key]

    layers = int(need("num_hidden_layers"))
    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv = int(c.get("num_key_value_heads", heads))
    head_dim = int(c.get("head_dim") or hidden // heads)
    hybrid = "linear_num_value_heads" in c or "layer_types" in c
    if c.get("layer_types"):
        types = list(c["layer_types"])
        if len(types) != layers:
            raise PlanError(f"config.json: layer_types has {len(types)} entries for {layers} layers")
    elif hybrid:
        interval = int(c.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    else:
        types = ["full_attention"] * layers
    n_full = sum(1 for t in types if t == "full_attention")
    quant = ckpt.config.get("quantization_config") or c.get("quantization_config") or {}
    block = quant.get("weight_block_size")
    dtype = str(c.get("torch_dtype") or c.get("dtype") or ckpt.config.get("torch_dtype") or "bfloat16")
    return ModelShape(
        hidden_size=hidden, num_layers=layers, num_full=n_full, num_linear=layers - n_full,
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        linear_nk=int(c.get("linear_num_key_heads", 0)), linear_nv=int(c.get("linear_num_value_heads", 0)),
        linear_dk=int(c.get("linear_key_head_dim", 0)), linear_dv=int(c.get("linear_value_head_dim", 0)),
        conv_kernel=int(c.get("linear_conv_kernel_dim", 4)),
        num_experts=int(c.get("num_experts", 0) or 0),
        moe_intermediate=int(c.get("moe_intermediate_size", 0) or 0),
        block=tuple(block) if block else None,
        dtype_bytes=4 if "32" in dtype else 2,
        vocab_size=int(c.get("vocab_size", 0) or 0),
    )


@dataclass
class Options:
    card: Card
    tp: int = 1
    ep: bool = False
    max_num_seqs: int = 64
    max_model_len: int = 16384
    gpu_memory_utilization: float = 0.9
    reserve_gib: float = 2.0  # activations, workspace, communication buffers: an estimate


@dataclass
class Plan:
    options: Options
    shape: ModelShape
    figures: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems


def _dense_fraction(t: Tensor, shape: ModelShape, tp: int) -> float:
    if tp == 1 or len(t.shape) <= 1:
        return 1.0
    if t.name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
        return 1.0  # routers are replicated
    if re.search(r"self_attn\.(k_proj|v_proj)\.", t.name):
        per_rank = max(1, shape.num_kv_heads // tp)
        return per_rank / shape.num_kv_heads
    return 1.0 / tp


def checkpoint_sums(ckpt: Checkpoint) -> dict:
    """Byte totals of the checkpoint by role (whole model, before sharding)."""
    sums = {"dense": 0, "dense_fp8": 0, "expert_stored": 0, "expert_weight_elems": 0,
            "expert_fp8_weight_bytes": 0, "per_layer": {}}
    for t in ckpt.tensors.values():
        if not _EXPERT.search(t.name):
            sums["dense"] += t.nbytes
            if t.dtype in FP8_DTYPES:
                sums["dense_fp8"] += t.nbytes
            continue
        m = _LAYER.search(t.name)
        layer = sums["per_layer"].setdefault(int(m.group(1)) if m else -1,
                                             {"stored": 0, "bf16_gate_up": 0, "bf16_down": 0})
        sums["expert_stored"] += t.nbytes
        layer["stored"] += t.nbytes
        if _SCALE.search(t.name):
            continue
        sums["expert_weight_elems"] += t.numel
        if t.dtype in FP8_DTYPES:
            sums["expert_fp8_weight_bytes"] += t.nbytes
        key = "bf16_gate_up" if _GATE_UP.search(t.name) else "bf16_down"
        layer[key] += t.numel * 2
    return sums


def make_plan(ckpt: Checkpoint, opts: Options, sums: dict | None = None) -> Plan:
    shape = model_shape(ckpt)
    sums = sums or checkpoint_sums(ckpt)
    tp, card = opts.tp, opts.card
    plan = Plan(opts, shape)
    p = plan.problems

    # Divisibility vLLM insists on.
    for label, value in (("num_attention_heads", shape.num_heads), ("linear_num_key_heads", shape.linear_nk),
                         ("linear_num_value_heads", shape.linear_nv)):
        if value and value % tp:
            p.append(f"{label}={value} is not divisible by TP {tp}")
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        p.append(f"num_key_value_heads={shape.num_kv_heads} and TP {tp}: neither divides the other")
    has_experts = sums["expert_stored"] > 0
    if opts.ep and tp == 1:
        p.append("EP needs TP > 1 (one card holds every expert anyway)")
    if has_experts and shape.num_experts <= 0:
        p.append("config.json: checkpoint has routed experts but num_experts is missing")
    if has_experts and not opts.ep and tp > 1 and shape.block and sums["expert_fp8_weight_bytes"]:
        per_rank = shape.moe_intermediate / tp
        if per_rank % shape.block[0]:
            p.append(f"without EP each card gets moe_intermediate_size/TP = {per_rank:g} rows, "
                     f"not a multiple of the FP8 block {shape.block[0]}: use --ep")

    # Weights per card.
    dense = sum(t.nbytes * _dense_fraction(t, shape, tp) for t in ckpt.tensors.values() if not _EXPERT.search(t.name))
    if opts.ep and shape.num_experts:
        efrac = math.ceil(shape.num_experts / tp) / shape.num_experts
    else:
        efrac = 1.0 / tp
    stored = sums["expert_stored"] * efrac
    expanded = sums["expert_weight_elems"] * 2 * efrac
    fp8_experts = sums["expert_fp8_weight_bytes"] > 0
    layers = sums["per_layer"].values()
    largest_layer_stored = max((lay["stored"] for lay in layers), default=0) * efrac
    largest_fused = max((max(lay["bf16_gate_up"], lay["bf16_down"]) for lay in layers), default=0) * efrac
    if fp8_experts and card.mxfp8:
        # Experts stay FP8 on the card; MX block scales: one byte per 32 elements.
        resident_experts = sums["expert_fp8_weight_bytes"] * efrac + sums["expert_weight_elems"] / 32 * efrac
        peak = dense + resident_experts + largest_layer_stored
        peak_unpatched = peak
        expert_mode = "kept FP8, MXFP8"
    elif fp8_experts:
        resident_experts = expanded
        # Expanded on the host, the FP8 copy of a layer freed before its bf16 copy lands:
        # the device never holds more than the final resident set.
        peak = dense + expanded
        # Upstream path: the last layer's FP8 source still resident, plus one device-side
        # transpose copy of its largest expanded tensor.
        peak_unpatched = dense + expanded + largest_layer_stored + largest_fused
        expert_mode = "expanded to bfloat16, no MXFP8"
    else:
        resident_experts = stored
        peak = peak_unpatched = dense + stored
        expert_mode = "as stored, not FP8"
    resident = dense + resident_experts

    # KV cache (full-attention layers) and linear-attention state (GDN layers).
    kv_heads_rank = max(1, shape.num_kv_heads // tp)
    kv_per_token = shape.num_full * 2 * kv_heads_rank * shape.head_dim * shape.dtype_bytes
    state_per_seq = 0
    if shape.num_linear and shape.linear_nv:
        conv = (2 * shape.linear_nk * shape.linear_dk + shape.linear_nv * shape.linear_dv) // tp * (shape.conv_kernel - 1)
        temporal = shape.linear_nv // tp * shape.linear_dv * shape.linear_dk
        state_per_seq = shape.num_linear * (conv + temporal) * shape.dtype_bytes
    per_seq = opts.max_model_len * kv_per_token + state_per_seq
    need = opts.max_num_seqs * per_seq

    budget = opts.gpu_memory_utilization * card.memory_bytes
    reserve = opts.reserve_gib * GIB
    left = budget - resident - reserve
    max_seqs = max(0, int(left // per_seq)) if per_seq else None
    plan.figures = {
        "dense": dense, "experts_stored": stored, "experts_bf16": expanded, "experts_resident": resident_experts,
        "expert_mode": expert_mode, "resident": resident, "load_peak": peak, "load_peak_unpatched": peak_unpatched,
        "budget": budget, "reserve": reserve, "left_for_cache": left, "kv_per_token": kv_per_token,
        "state_per_seq": state_per_seq, "cache_needed": need, "max_num_seqs_that_fit": max_seqs,
        "card_bytes": card.memory_bytes, "dense_fp8": sums["dense_fp8"],
    }
    if peak > budget:
        p.append(f"load peak {peak / GIB:.2f} GiB exceeds the stage's {budget / GIB:.2f} GiB "
                 f"({opts.gpu_memory_utilization:g} of {card.memory_gib:g} GiB)")
    elif left < need:
        p.append(f"KV cache + linear-attention state for {opts.max_num_seqs} x {opts.max_model_len} tokens needs "
                 f"{need / GIB:.2f} GiB, {max(left, 0) / GIB:.2f} GiB left"
                 + (f" (max_num_seqs {max_seqs} would fit)" if max_seqs else ""))
    return plan


def smallest_fit(ckpt: Checkpoint, opts: Options, max_tp: int = 16) -> list[tuple[int, bool]]:
    """The (tp, ep) choices that fit at the smallest TP that has any, or []."""
    sums = checkpoint_sums(ckpt)
    tp = 1
    while tp <= max_tp:
        found = []
        for ep in ((False,) if tp == 1 else (False, True)):
            trial = Options(**{**opts.__dict__, "tp": tp, "ep": ep})
            if make_plan(ckpt, trial, sums).fits:
                found.append((tp, ep))
        if found:
            return found
        tp *= 2
    return []
