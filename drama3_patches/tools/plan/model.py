"""Per-card memory plan for Drama 3 (vLLM-Omni's ``fish_omni``) and other Qwen3-Next-style MoE checkpoints.

Reads ``config.json``, the safetensors headers and, for Drama 3, the DAC codec's
``codec.pth``; tensor data is never read. Tensor names, shapes and dtypes come
from the ``safetensors`` package (``safe_open(...).get_slice(name)``), which
reads only the header; ``codec.pth`` is opened with ``torch.load(mmap=True)``,
which maps the file without reading the tensors.

Model shape. A ``fish_omni`` ``config.json`` (vLLM-Omni 0.32.0rc1,
``configuration_fish_omni.py``) is read through ``FishOmniConfig`` when that
release is installed, else as plain JSON with the same keys: the Qwen3.5-MoE
backbone under ``text_config`` (full attention vs gated-delta-net layers by
``layer_types``, routed experts, KV heads, head dim) and the codebook tower
under ``audio_decoder_config``. Any other config uses Qwen3-Next ``config.json``
fields (the top level or a nested section).

Both Drama 3 stages are planned. Stage 0 (the AR stage) holds the backbone,
the lm_head rows the model keeps (end of speech and the semantic codes), the
codebook tower (its layers after the first fold ``eh_proj``'s embedding half
into a per-code table at load), the DAC encoder in float32 (reference audio
for voice cloning) and the per-slot code history; per token, the KV cache of
the backbone's full-attention layers and of every tower layer; per sequence,
the gated-delta-net state, shaped as vLLM's
``MambaStateShapeCalculator.gated_delta_net_state_shape`` (conv state in the
model dtype, temporal state in ``mamba_ssm_cache_dtype``). Stage 1 (the DAC
decoder) holds the codec without its encoder, in the decoder dtype, with
weight norms baked (the magnitude tensors go).

Sharding is an estimate of what vLLM does: 2-D+ dense backbone tensors split
by TP (k/v projections by whole KV heads, replicated when there are fewer heads
than ranks), 1-D tensors and MoE routers replicated; routed experts split by TP
(intermediate dim) or, with EP, spread whole (``ceil(E/tp)`` per card). The
fish_omni head and tower are plain modules: replicated.
"""

from __future__ import annotations

import functools
import math
import os
import re
import time
from dataclasses import dataclass, field

from drama3_patches.tools.plan import inputs
from drama3_patches.tools.plan.cards import GIB, Card

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
CACHE_DTYPE_BYTES = {"auto": None, "float32": 4, "bfloat16": 2, "float16": 2}
DAC_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
INDEX_FILE = "model.safetensors.index.json"
CODEC_FILE = "codec.pth"
MAX_CODEC_BYTES = 16 << 30  # the published DAC codec is under 2 GiB in float32
MAX_CODEC_PICKLE_BYTES = 64 << 20  # torch.load reads the archive's pickle whole: names and shapes, kilobytes

FISH_OMNI = "fish_omni"
OMNI_RELEASE = "0.32.0rc1"  # the release whose FishOmniConfig this reads
BACKBONE_PREFIX = "model.language_model."
TOWER_PREFIXES = ("audio_decoder.", "audio_decoder_mtp.", "audio_decoder_mtp_shared.")
# FishOmniConfig's own defaults, for a config.json read as plain JSON that leaves a field out.
FISH_DEFAULTS = {"semantic_start_token_id": 248099, "semantic_end_token_id": 252194, "eos_token_id": 248046}
DECODER_DEFAULTS = {"dim": 2048, "n_head": 16, "n_local_heads": 2, "head_dim": 256, "intermediate_size": 6144,
                    "num_codebooks": 10, "vocab_size": 4096, "shared_enrichment_layers": 4}
# codec.pth parts each stage drops before moving the codec to its card.
DAC_ENCODER_ONLY = ("encoder.", "quantizer.pre_module.", "quantizer.downsample.")
DAC_DECODER_ONLY = ("decoder.",)
WEIGHT_NORM_MAGNITUDE = re.compile(r"(\.weight_g|\.parametrizations\.weight\.original0)$")

_EXPERT = re.compile(r"\.experts\.(\d+\.|w13_|w2_|gate_up_proj|down_proj)")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_SCALE = re.compile(r"(weight_scale_inv|weight_scale|_scale_inv|_scale)$")
_GATE_UP = re.compile(r"(gate_proj|up_proj|gate_up_proj|w13_|\.w1\.|\.w3\.)")
_TOWER_LAYER = re.compile(r"^audio_decoder_mtp(_shared)?\.layers\.(\d+)\.")


class PlanError(Exception):
    """Bad input; the message is one line an operator can act on."""


def _quiet(message: str) -> None:
    pass


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


def read_tensors(path: str) -> dict[str, Tensor]:
    """Name, dtype and shape of every tensor of one safetensors file; the data is not read."""
    from safetensors import SafetensorError, safe_open

    name = os.path.basename(path)
    tensors: dict[str, Tensor] = {}
    try:
        with safe_open(path, framework="numpy") as fh:
            for tname in fh.keys():
                piece = fh.get_slice(tname)
                dtype = piece.get_dtype()
                if dtype not in DTYPE_BYTES:
                    raise PlanError(f"{name}: tensor {tname!r} has dtype {dtype!r}, which plan does not know")
                tensors[tname] = Tensor(tname, dtype, tuple(int(d) for d in piece.get_shape()), name)
    except SafetensorError as exc:
        raise PlanError(f"{name}: not a readable safetensors file: {exc}") from None
    except OSError as exc:
        raise PlanError(f"{name}: cannot read: {exc.strerror or exc}") from None
    return tensors


def _check_codec_size(path: str, name: str) -> None:
    """Refuse a codec file, or the pickle in its archive, larger than any DAC codec is: torch.load
    maps the tensors' data but reads and unpickles the pickle whole."""
    import zipfile

    size = os.stat(path).st_size
    if size > MAX_CODEC_BYTES:
        raise PlanError(f"{name}: {size / GIB:.1f} GiB, over the {MAX_CODEC_BYTES / GIB:.1f} GiB limit "
                        "for a codec file")
    try:
        with zipfile.ZipFile(path) as archive:
            pickled = sum(i.file_size for i in archive.infolist() if i.filename.endswith(".pkl"))
    except (zipfile.BadZipFile, OSError) as exc:
        raise PlanError(f"{name}: not a torch zip archive: {exc}") from None
    if pickled > MAX_CODEC_PICKLE_BYTES:
        raise PlanError(f"{name}: its pickle is {pickled / inputs.MIB:.1f} MiB, over the "
                        f"{MAX_CODEC_PICKLE_BYTES / inputs.MIB:.1f} MiB limit for a state dict's names and shapes")


def read_codec(path: str) -> dict[str, Tensor]:
    """Tensors of the DAC codec's ``codec.pth`` (a torch state dict, maybe under "generator"),
    mapped with ``torch.load(mmap=True)``: the shapes come from the pickle, the data stays on disk."""
    try:
        import torch
    except ImportError:
        raise PlanError(f"{CODEC_FILE}: reading it needs torch (install the torch the vLLM pair pins)") from None
    name = os.path.basename(path)
    _check_codec_size(path, name)
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # a torch archive that does not open says why in its own words
        raise PlanError(f"{name}: not a readable torch state dict: {type(exc).__name__}: {exc}") from None
    if isinstance(state, dict) and isinstance(state.get("generator"), dict):
        state = state["generator"]
    if not isinstance(state, dict):
        raise PlanError(f"{name}: not a state dict")
    out = {}
    for key, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        out[key] = Tensor(key, str(t.dtype).removeprefix("torch."), tuple(t.shape), name)  # numel only: no nbytes
    return out


@dataclass
class Checkpoint:
    path: str
    config: dict
    text_config: dict
    text_section: str
    files: list[str]
    tensors: dict[str, Tensor]
    kind: str = "generic"             # "fish_omni" or "generic"
    config_source: str = "config.json"
    decoder_config: dict = field(default_factory=dict)
    codec: dict | None = None        # codec.pth tensors (fish_omni), None when absent
    codec_note: str = ""
    seconds: float = 0.0


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


@functools.lru_cache(maxsize=None)
def _fish_omni_class():
    """vLLM-Omni 0.32.0rc1's FishOmniConfig, or None. Loaded from its file alone: importing the
    vllm_omni package would import vLLM, and the config module needs only transformers."""
    import importlib.util

    from drama3_patches.versions import installed_version

    if installed_version("vllm-omni") != OMNI_RELEASE:
        return None
    try:
        spec = importlib.util.find_spec("vllm_omni")
        if spec is None or not spec.submodule_search_locations:
            return None
        path = os.path.join(spec.submodule_search_locations[0], "model_executor", "models", "fish_omni",
                            "configuration_fish_omni.py")
        mspec = importlib.util.spec_from_file_location("_drama3_plan_fish_omni_config", path)
        module = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(module)
        return module.FishOmniConfig
    except Exception:  # not importable here (no transformers, a changed file): read the JSON instead
        return None


def fish_omni_fields(config: dict, use_class: bool = True, progress=_quiet) -> tuple[dict, dict, dict, str]:
    """(text fields, audio-decoder fields, top-level ids, where they were read) of a fish_omni config."""
    cls = _fish_omni_class() if use_class else None
    if cls is not None:
        progress(f"reading config.json through vllm-omni {OMNI_RELEASE}'s FishOmniConfig")
        try:
            cfg = cls.from_dict(dict(config))
        except (ValueError, TypeError) as exc:
            raise PlanError(f"config.json: FishOmniConfig refuses it: {exc}") from None
        text = cfg.text_config.to_dict()
        decoder = cfg.audio_decoder_config.to_dict()
        ids = {k: int(getattr(cfg, k)) for k in FISH_DEFAULTS}
        return text, decoder, ids, f"FishOmniConfig (vllm-omni {OMNI_RELEASE})"
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise PlanError("config.json: fish_omni config without a text_config section")
    decoder = dict(DECODER_DEFAULTS, **(config.get("audio_decoder_config") or {}))
    ids = {k: int(config.get(k, v)) for k, v in FISH_DEFAULTS.items()}
    return dict(text), decoder, ids, "config.json read as JSON (fish_omni format)"


def _load_json(path: str, limit: int = inputs.MAX_CONFIG_BYTES):
    """A regular file of bounded size and depth (``inputs.load_json``); bad input is one line."""
    return inputs.load_json(path, limit)


def load_checkpoint(path: str, section: str | None = None, progress=_quiet, use_class: bool = True) -> Checkpoint:
    """Config, tensor list and (fish_omni) codec of a checkpoint directory; ``progress`` gets one
    line per step that may take a while."""
    started = time.perf_counter()
    if not os.path.isdir(path):
        raise PlanError(f"{path}: not a directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise PlanError(f"{path}: no config.json")
    config = _load_json(cfg_path)
    if not isinstance(config, dict):
        raise PlanError(f"{cfg_path}: not a JSON object")
    inputs.check_config(config, cfg_path, config.get("model_type") == FISH_OMNI)
    kind, source, decoder, ids = "generic", "config.json", {}, {}
    if section:
        where, text = section, _section(config, section)
        if "num_hidden_layers" not in text or "hidden_size" not in text:
            raise PlanError(f"config.json: section {section!r} has no num_hidden_layers and hidden_size")
    elif config.get("model_type") == FISH_OMNI:
        kind, where = FISH_OMNI, "text_config"
        text, decoder, ids, source = fish_omni_fields(config, use_class, progress)
    else:
        where, text = _text_config(config)
    if not text:
        raise PlanError(f"{cfg_path}: no language-model section with num_hidden_layers and hidden_size")
    inputs.check_model(dict(text, **ids), decoder, config, cfg_path, where)

    index_path = os.path.join(path, INDEX_FILE)
    expected: dict[str, str] = {}
    if os.path.isfile(index_path):
        index = _load_json(index_path, inputs.MAX_INDEX_BYTES)
        expected = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(expected, dict):
            raise PlanError(f"{index_path}: not a valid index (needs a weight_map object)")
        inputs.check_weight_map(expected, index_path)
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
    for n, f in enumerate(files, 1):
        if len(files) > 1:
            progress(f"reading tensor shapes of {f} ({n}/{len(files)})")
        tensors.update(read_tensors(os.path.join(path, f)))
    for tname, f in expected.items():
        if tname not in tensors:
            raise PlanError(f"{INDEX_FILE} places {tname} in {f}, whose header does not have it")
    ckpt = Checkpoint(path, config, dict(text, **ids), where, files, tensors, kind, source, decoder)
    if kind == FISH_OMNI:
        codec_path = os.path.join(path, CODEC_FILE)
        if os.path.isfile(codec_path):
            progress(f"reading {CODEC_FILE} (DAC codec) tensor shapes through torch.load(mmap=True)")
            ckpt.codec = read_codec(codec_path)
        else:
            ckpt.codec_note = f"no {CODEC_FILE} in {path}: the DAC stage and stage 0's reference encoder are not counted"
    ckpt.seconds = time.perf_counter() - started
    if len(files) > 1:
        progress(f"read {len(tensors)} tensors from {len(files)} files in {ckpt.seconds:.2f} s")
    return ckpt


@dataclass(frozen=True)
class TowerShape:
    num_layers: int       # shared enrichment layers + one per codebook after the first
    dim: int
    num_kv_heads: int
    head_dim: int
    num_codebooks: int
    head_rows: int        # lm_head rows kept: end of speech and semantic codes 1..end


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
    tower: TowerShape | None = None


def _dtype_bytes(name: str) -> int:
    return 4 if "32" in name else 2


def model_shape(ckpt: Checkpoint) -> ModelShape:
    c = ckpt.text_config

    def need(key):
        if c.get(key) is None:
            raise PlanError(f"config.json: missing {key}" + (" in text_config" if ckpt.kind == FISH_OMNI else ""))
        return c[key]

    layers = int(need("num_hidden_layers"))
    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv = int(c.get("num_key_value_heads") or heads)
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
    dtype = str(ckpt.config.get("dtype") or ckpt.config.get("torch_dtype") or c.get("torch_dtype")
                or c.get("dtype") or "bfloat16")
    tower = None
    if ckpt.kind == FISH_OMNI:
        d = ckpt.decoder_config
        begin, end, eos = c["semantic_start_token_id"], c["semantic_end_token_id"], c["eos_token_id"]
        tower = TowerShape(
            num_layers=int(d["shared_enrichment_layers"]) + int(d["num_codebooks"]) - 1, dim=int(d["dim"]),
            num_kv_heads=int(d["n_local_heads"]), head_dim=int(d["head_dim"]), num_codebooks=int(d["num_codebooks"]),
            head_rows=len({eos, *range(begin + 1, end + 1)}),
        )
    return ModelShape(
        hidden_size=hidden, num_layers=layers, num_full=n_full, num_linear=layers - n_full,
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        linear_nk=int(c.get("linear_num_key_heads", 0)), linear_nv=int(c.get("linear_num_value_heads", 0)),
        linear_dk=int(c.get("linear_key_head_dim", 0)), linear_dv=int(c.get("linear_value_head_dim", 0)),
        conv_kernel=int(c.get("linear_conv_kernel_dim", 4)),
        num_experts=int(c.get("num_experts", 0) or 0),
        moe_intermediate=int(c.get("moe_intermediate_size", 0) or 0),
        block=tuple(block) if block else None,
        dtype_bytes=_dtype_bytes(dtype),
        vocab_size=int(c.get("vocab_size", 0) or 0),
        tower=tower,
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
    mamba_ssm_cache_dtype: str = "auto"
    max_num_batched_tokens: int = 4096
    dac_gpu_memory_utilization: float = 0.1  # the published fish_omni.yaml's stage 1 share
    dac_dtype: str = "float32"               # the DAC decoder's default (fish_speech_dac_dtype)
    tower_split: bool = True                 # fish-omni-tower-tp-split: the tower's heads per TP rank
    ep_weight_filter: bool = False           # vLLM's enable_ep_weight_filter: each rank reads its own experts


@dataclass
class Plan:
    options: Options
    shape: ModelShape
    figures: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems


def _dense_fraction(name: str, t: Tensor, shape: ModelShape, tp: int) -> float:
    if tp == 1 or len(t.shape) <= 1:
        return 1.0
    if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
        return 1.0  # routers are replicated
    if re.search(r"self_attn\.(k_proj|v_proj)\.", name):
        per_rank = max(1, shape.num_kv_heads // tp)
        return per_rank / shape.num_kv_heads
    return 1.0 / tp


def expert_layers(ckpt) -> list:
    """The checkpoint's expert tensors summed per layer (``fp8_routes.ExpertLayer``), in the order vLLM
    post-processes them."""
    from drama3_patches.tools.plan.fp8_routes import ExpertLayer

    layers: dict[int, ExpertLayer] = {}
    for t in ckpt.tensors.values():
        if _role(ckpt, t.name) != "expert":
            continue
        m = _LAYER.search(t.name)
        index = int(m.group(1)) if m else -1
        layer = layers.setdefault(index, ExpertLayer(index))
        part = "w13" if _GATE_UP.search(t.name) else "w2"
        setattr(layer, f"{part}_stored", getattr(layer, f"{part}_stored") + t.nbytes)
        if not _SCALE.search(t.name):
            setattr(layer, f"{part}_bf16", getattr(layer, f"{part}_bf16") + t.numel * 2)
    return [layers[i] for i in sorted(layers)]


def _role(ckpt: Checkpoint, name: str) -> str:
    """backbone, expert, head or tower (fish_omni); backbone or expert otherwise."""
    if ckpt.kind != FISH_OMNI:
        return "expert" if _EXPERT.search(name) else "backbone"
    if name.startswith(BACKBONE_PREFIX):
        return "expert" if _EXPERT.search(name) else "backbone"
    if name == "lm_head.weight":
        return "head"
    if name.startswith(TOWER_PREFIXES):
        return "tower"
    raise PlanError(f"{ckpt.tensors[name].file}: tensor {name!r} is not a fish_omni weight "
                    "(the published model refuses unexpected checkpoint keys)")


def _matrix(t: Tensor) -> Tensor:
    """``t`` when it is a 2-d weight with rows and columns; the sums below divide by its rows."""
    if len(t.shape) != 2 or 0 in t.shape:
        raise PlanError(f"{t.file}: tensor {t.name!r} has shape {list(t.shape)}, not a 2-d weight matrix")
    return t


def checkpoint_sums(ckpt: Checkpoint) -> dict:
    """Byte totals of the checkpoint by role (whole model, before sharding)."""
    shape = model_shape(ckpt)
    sums = {"dense": 0, "dense_fp8": 0, "expert_stored": 0, "expert_weight_elems": 0,
            "expert_fp8_weight_bytes": 0, "per_layer": {}, "head": 0, "tower": 0, "tower_folded": 0,
            "dac_encoder_elems": 0, "dac_decoder_elems": 0, "stored_total": 0, "expert_w_stored": 0,
            "tower_qkv": 0, "tower_o": 0, "tower_heads": 0}
    for t in ckpt.tensors.values():
        role = _role(ckpt, t.name)
        sums["stored_total"] += t.nbytes
        if role == "head":
            # Only the rows the model samples stay on the card (FishOmniForConditionalGeneration).
            sums["head"] += shape.tower.head_rows * (t.nbytes // _matrix(t).shape[0])
            continue
        if role == "tower":
            sums["tower"] += t.nbytes
            if t.name.endswith(".attention.wqkv.weight"):
                # Rows [q | gate | k | v]: the query heads follow from the rows and the KV heads.
                sums["tower_qkv"] += t.nbytes
                rows = _matrix(t).shape[0] // shape.tower.head_dim - 2 * shape.tower.num_kv_heads
                sums["tower_heads"] = rows // 2
            elif t.name.endswith(".attention.wo.weight"):
                sums["tower_o"] += t.nbytes
            m = _TOWER_LAYER.match(t.name)
            index = (int(m.group(2)) + (0 if m.group(1) else int(ckpt.decoder_config["shared_enrichment_layers"]))
                     if m else None)
            if index and t.name.endswith(".eh_proj.weight"):
                # The embedding half becomes a per-code table the size of the (emptied) embedding.
                sums["tower_folded"] += _matrix(t).nbytes // 2
            continue
        if role == "backbone":
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
        sums["expert_w_stored"] += t.nbytes
        sums["expert_weight_elems"] += t.numel
        if t.dtype in FP8_DTYPES:
            sums["expert_fp8_weight_bytes"] += t.nbytes
        key = "bf16_gate_up" if _GATE_UP.search(t.name) else "bf16_down"
        layer[key] += t.numel * 2
    for t in (ckpt.codec or {}).values():
        if not t.name.startswith(DAC_DECODER_ONLY):
            sums["dac_encoder_elems"] += t.numel  # stage 0 keeps weight norms as loaded
        if not t.name.startswith(DAC_ENCODER_ONLY) and not WEIGHT_NORM_MAGNITUDE.search(t.name):
            sums["dac_decoder_elems"] += t.numel
    return sums


def make_plan(ckpt: Checkpoint, opts: Options, sums: dict | None = None) -> Plan:
    shape = model_shape(ckpt)
    sums = sums or checkpoint_sums(ckpt)
    tp, card = opts.tp, opts.card
    plan = Plan(opts, shape)
    p = plan.problems
    fish = ckpt.kind == FISH_OMNI

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
    if fish and tp > 1:
        plan.notes.append(f"vllm-omni {OMNI_RELEASE}'s FishOmniForConditionalGeneration refuses "
                          f"tensor_parallel_size != 1: TP {tp} needs the patch fish-omni-tensor-parallel"
                          + ("; the tower's heads per rank: fish-omni-tower-tp-split" if opts.tower_split else ""))
    # The tower's attention heads on each card (fish-omni-tower-tp-split), KV heads replicated when
    # fewer than the ranks; the published tower keeps all of them on every card.
    tower_heads = sums.get("tower_heads", 0)
    split = bool(fish and shape.tower and tp > 1 and opts.tower_split and tower_heads)
    if split and (tower_heads % tp or (shape.tower.num_kv_heads % tp and tp % shape.tower.num_kv_heads)):
        plan.notes.append(f"the codebook tower's {tower_heads} heads / {shape.tower.num_kv_heads} KV heads do "
                          f"not split over TP {tp}: the tower stays whole on every card")
        split = False
    tower_kv_heads = max(1, shape.tower.num_kv_heads // tp) if split else (shape.tower.num_kv_heads if shape.tower else 0)

    # Weights per card.
    dense = sum(t.nbytes * _dense_fraction(t.name[len(BACKBONE_PREFIX):] if fish else t.name, t, shape, tp)
                for t in ckpt.tensors.values() if _role(ckpt, t.name) == "backbone")
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
    head = sums["head"]
    tower = sums["tower"] - sums["tower_folded"]
    if split:
        qkv_rows = 2 * tower_heads + 2 * shape.tower.num_kv_heads
        tower -= sums["tower_qkv"] * (1 - (2 * tower_heads // tp + 2 * tower_kv_heads) / qkv_rows)
        tower -= sums["tower_o"] * (1 - 1 / tp)
    # Safetensors bytes each rank reads: every tensor (sharding happens after the read), except,
    # with EP and vLLM's weight filter, the other ranks' expert weights (their scales are still read).
    filtered = bool(opts.ep and opts.ep_weight_filter and shape.num_experts and tp > 1)
    disk_read = sums["stored_total"] - (sums["expert_w_stored"] * (1 - math.ceil(shape.num_experts / tp)
                                                                   / shape.num_experts) if filtered else 0)
    dac_encoder = sums["dac_encoder_elems"] * 4  # float32, as the AR stage loads it
    buffers = 0
    if fish:
        # Per-slot code history (int16, max_num_seqs + 1 slots) and the persistent input embeddings.
        buffers = ((opts.max_num_seqs + 1) * opts.max_model_len * shape.tower.num_codebooks * 2
                   + opts.max_num_batched_tokens * shape.hidden_size * shape.dtype_bytes)
    other = head + tower + dac_encoder + buffers
    if fp8_experts and card.mxfp8:
        # Experts stay FP8 on the card; MX block scales: one byte per 32 elements.
        resident_experts = sums["expert_fp8_weight_bytes"] * efrac + sums["expert_weight_elems"] / 32 * efrac
        peak = dense + other + resident_experts + largest_layer_stored
        peak_unpatched = peak
        expert_mode = "kept FP8, MXFP8"
    elif fp8_experts:
        resident_experts = expanded
        # Expanded on the host, the FP8 copy of a layer freed before its bf16 copy lands:
        # the device never holds more than the final resident set.
        peak = dense + other + expanded
        # Upstream path: the last layer's FP8 source still resident, plus one device-side
        # transpose copy of its largest expanded tensor.
        peak_unpatched = dense + other + expanded + largest_layer_stored + largest_fused
        expert_mode = "expanded to bfloat16, no MXFP8"
    else:
        resident_experts = stored
        peak = peak_unpatched = dense + other + stored
        expert_mode = "as stored, not FP8"
    resident = dense + other + resident_experts

    # KV cache (full-attention layers; fish_omni: and every tower layer) and gated-delta-net state.
    kv_heads_rank = max(1, shape.num_kv_heads // tp)
    kv_per_token = shape.num_full * 2 * kv_heads_rank * shape.head_dim * shape.dtype_bytes
    kv_tower = 0
    if shape.tower:
        kv_tower = shape.tower.num_layers * 2 * tower_kv_heads * shape.tower.head_dim * shape.dtype_bytes
        kv_per_token += kv_tower
    state_per_seq = 0
    ssm_bytes = CACHE_DTYPE_BYTES[opts.mamba_ssm_cache_dtype] or shape.dtype_bytes
    if shape.num_linear and shape.linear_nv:
        conv = (2 * shape.linear_nk * shape.linear_dk + shape.linear_nv * shape.linear_dv) // tp * (shape.conv_kernel - 1)
        temporal = shape.linear_nv // tp * shape.linear_dv * shape.linear_dk
        state_per_seq = shape.num_linear * (conv * shape.dtype_bytes + temporal * ssm_bytes)
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
        "disk_read_per_rank": disk_read, "disk_read_filtered": filtered,
    }
    if fp8_experts and not card.mxfp8:
        from drama3_patches.tools.plan import fp8_routes

        routes = fp8_routes.route_peaks(expert_layers(ckpt), shape, efrac, dense + other)
        if routes:
            routes["route"], routes["why"] = fp8_routes.choose(routes, budget)
            plan.figures["fp8_routes"] = routes
    if fish:
        plan.figures.update({"head": head, "tower": tower, "dac_encoder": dac_encoder, "model_buffers": buffers,
                             "kv_per_token_tower": kv_tower, "tower_split": split, "tower_kv_heads": tower_kv_heads})
    if peak > budget:
        p.append(f"load peak {peak / GIB:.2f} GiB exceeds the stage's {budget / GIB:.2f} GiB "
                 f"({opts.gpu_memory_utilization:g} of {card.memory_gib:g} GiB)")
    elif left < need:
        p.append(f"KV cache + linear-attention state for {opts.max_num_seqs} x {opts.max_model_len} tokens needs "
                 f"{need / GIB:.2f} GiB, {max(left, 0) / GIB:.2f} GiB left"
                 + (f" (max_num_seqs {max_seqs} would fit)" if max_seqs else ""))

    if fish and shape.num_linear and left > 0:
        plan.notes.append("the cache figures count bytes per token and per sequence; vLLM also rounds to KV "
                          "groups and pads the linear-attention state to an attention block, which holds fewer "
                          "full-length sequences: `python benchmarks/tower_kv_groups.py --memory-gib "
                          f"{left / GIB:.2f} --max-model-len {opts.max_model_len}` prints vLLM's own count")
    if fish and ckpt.codec is not None:
        # Stage 1, the DAC decoder, on a card it shares with stage 0 (the published deploy and the
        # shipped profiles put it beside an AR rank).
        dac = sums["dac_decoder_elems"] * DAC_DTYPE_BYTES[opts.dac_dtype]
        dac_budget = opts.dac_gpu_memory_utilization * card.memory_bytes
        plan.figures.update({"dac_weights": dac, "dac_budget": dac_budget, "dac_left": dac_budget - dac})
        share = opts.gpu_memory_utilization + opts.dac_gpu_memory_utilization
        if share > 1 + 1e-9:
            p.append(f"stage 0 ({opts.gpu_memory_utilization:g}) and the DAC stage "
                     f"({opts.dac_gpu_memory_utilization:g}) ask for {share:.2f} of the card they share")
        if dac > dac_budget:
            p.append(f"DAC stage weights {dac / GIB:.2f} GiB exceed its {dac_budget / GIB:.2f} GiB "
                     f"({opts.dac_gpu_memory_utilization:g} of {card.memory_gib:g} GiB)")
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
