"""What ``plan`` reads, checked where it is read: config.json, the shard index, a deploy YAML.

Files are read through :func:`drama3_patches.tools.files.read_text` (regular files of bounded
size) and refused when nested deeper or holding more values than any real one; each field
the plan computes with is checked for its type and range, so a string layer count, zero heads
or a list where a mapping belongs is one line naming the field and the file (an
:class:`~drama3_patches.tools.files.InputError`, exit 2), never a traceback in the arithmetic.
"""

from __future__ import annotations

import json
import math
import posixpath

from drama3_patches.tools.files import MIB, InputError, read_text

MAX_CONFIG_BYTES = 16 * MIB  # a config.json is kilobytes
MAX_INDEX_BYTES = 128 * MIB  # a shard index names every tensor: megabytes for the largest models
MAX_DEPLOY_BYTES = 4 * MIB
MAX_DEPTH = 32  # real configs nest three or four levels
MAX_NODES = 2_000_000  # values in one file; also stops a YAML alias bomb from being walked
MAX_COUNT = 1 << 20  # layers, heads, dims, experts: a bound that keeps every range() small
MAX_TOKEN_ID = 1 << 24


def _bad(where: str, field: str, problem: str) -> InputError:
    return InputError(f"{where}: {field} {problem}")


def _walk(obj, where: str) -> None:
    """Refuse a document nested deeper than MAX_DEPTH or holding more than MAX_NODES values
    (iterative: a deep document cannot exhaust the stack here)."""
    stack, nodes = [(obj, 1)], 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise InputError(f"{where}: more than {MAX_NODES} values; not a config this reads")
        if isinstance(node, (dict, list)):
            if depth > MAX_DEPTH:
                raise InputError(f"{where}: nested more than {MAX_DEPTH} levels deep; not a config this reads")
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))


def _load(path: str, limit: int, what: str, parse, syntax_error, kind: str):
    text = read_text(path, limit, what)
    try:
        data = parse(text)
    except RecursionError:
        raise InputError(f"{path}: nested too deep to read") from None
    except syntax_error as exc:
        raise InputError(f"{path}: not valid {kind} ({' '.join(str(exc).split())})") from None
    _walk(data, path)
    return data


def load_json(path: str, limit: int = MAX_CONFIG_BYTES, what: str = "JSON file"):
    return _load(path, limit, what, json.loads, ValueError, "JSON")


def load_yaml(path: str, limit: int = MAX_DEPLOY_BYTES, what: str = "deploy file"):
    import yaml

    return _load(path, limit, what, yaml.safe_load, yaml.YAMLError, "YAML")


def mapping(value, where: str, field: str, required: bool = False) -> dict:
    """``value`` as a dict: ``{}`` when absent (unless required), refused when another type."""
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise _bad(where, field, f"is {_what(value)}; it must be a mapping (key: value)")
    return value


def integer(value, where: str, field: str, low: int = 1, high: int = MAX_COUNT) -> int:
    """An int in [low, high] (a bool is not one; a float with no fraction is taken, as JSON writers
    sometimes emit 2.0)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(where, field, f"is {_what(value)}; it must be a whole number")
    if value < low:
        raise _bad(where, field, f"is {value}; it must be at least {low}")
    if value > high:
        raise _bad(where, field, f"is {value}; this reads at most {high}")
    return value


def number(value, where: str, field: str, low: float, high: float, low_open: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(where, field, f"is {_what(value)}; it must be a number")
    if not (low < value if low_open else low <= value) or value > high:
        raise _bad(where, field, f"is {value:g}; it must be in {'(' if low_open else '['}{low:g}, {high:g}]")
    return float(value)


# Language-model fields the plan computes with: (field, smallest allowed, required).
_TEXT_INTS = (("num_hidden_layers", 1, True), ("hidden_size", 1, True), ("num_attention_heads", 1, True),
              ("num_key_value_heads", 1, False), ("head_dim", 1, False), ("linear_num_key_heads", 0, False),
              ("linear_num_value_heads", 0, False), ("linear_key_head_dim", 0, False),
              ("linear_value_head_dim", 0, False), ("linear_conv_kernel_dim", 1, False),
              ("full_attention_interval", 1, False), ("num_experts", 0, False), ("moe_intermediate_size", 0, False),
              ("vocab_size", 0, False))
_DECODER_INTS = (("dim", 1), ("n_local_heads", 1), ("head_dim", 1), ("num_codebooks", 1),
                 ("shared_enrichment_layers", 0))
_IDS = ("semantic_start_token_id", "semantic_end_token_id", "eos_token_id")
_DTYPE_KEYS = ("dtype", "torch_dtype")


def check_config(config, path: str, fish_omni: bool) -> dict:
    """The raw config.json's structure, before any section of it is read."""
    config = mapping(config, path, "the top level", required=True)
    for key in ("text_config", "audio_decoder_config", "quantization_config"):
        mapping(config.get(key), path, key)
    if fish_omni:
        for key in _IDS:
            if config.get(key) is not None:
                integer(config[key], path, key, 0, MAX_TOKEN_ID)
    return config


def check_model(text: dict, decoder: dict, config: dict, path: str, section: str) -> None:
    """The fields of the language-model section (and, for fish_omni, the codebook tower) that the
    plan computes with: each of the right type and range."""
    where = f"{path} ({section})" if section and section != "(top level)" else path
    for key, low, required in _TEXT_INTS:
        value = text.get(key)
        if value is None and not required:
            continue
        if value is None:
            raise _bad(where, key, "is missing")
        integer(value, where, key, low)
    types = text.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise _bad(where, "layer_types", f"is {_what(types)}; it must be a list of layer type names")
    if text.get("num_key_value_heads") is None and text.get("head_dim") is None:
        if text["hidden_size"] % text["num_attention_heads"]:
            raise _bad(where, "hidden_size", f"{text['hidden_size']} is not a multiple of num_attention_heads "
                                             f"{text['num_attention_heads']} (and no head_dim is given)")
    for owner, name in ((config, "quantization_config"), (text, "quantization_config")):
        quant = mapping(owner.get(name), where if owner is text else path, name)
        block = quant.get("weight_block_size")
        if block is not None:
            if not isinstance(block, list) or len(block) != 2:
                raise _bad(path, f"{name}.weight_block_size", f"is {_what(block)}; it must be [rows, columns]")
            for n in block:
                integer(n, path, f"{name}.weight_block_size", 1)
    for owner in (config, text):
        for key in _DTYPE_KEYS:
            if owner.get(key) is not None and not isinstance(owner[key], str):
                raise _bad(path, key, f"is {_what(owner[key])}; it must be a dtype name such as bfloat16")
    if decoder:
        for key, low in _DECODER_INTS:
            integer(decoder.get(key), f"{path} (audio_decoder_config)", key, low)
        ids = {key: integer(text.get(key), path, key, 0, MAX_TOKEN_ID) for key in _IDS}
        if ids["semantic_end_token_id"] < ids["semantic_start_token_id"]:
            raise _bad(path, "semantic_end_token_id", f"{ids['semantic_end_token_id']} is below "
                                                      f"semantic_start_token_id {ids['semantic_start_token_id']}")


def check_weight_map(weight_map: dict, path: str) -> None:
    """Every shard a checkpoint's index names is a plain file name inside the checkpoint."""
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise _bad(path, f"weight_map[{tensor!r}]", f"is {_what(shard)}; it must be a shard file name")
        if posixpath.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
            raise _bad(path, f"weight_map[{tensor!r}]", f"is {shard!r}, outside the checkpoint folder")


# The deploy keys the plan reads, with their kinds, and the option each one sets.
_STAGE0 = (("tensor_parallel_size", "int", "tp"), ("max_num_seqs", "int", "max_num_seqs"),
           ("max_model_len", "int", "max_model_len"), ("max_num_batched_tokens", "int", "max_num_batched_tokens"),
           ("gpu_memory_utilization", "share", "gpu_memory_utilization"),
           ("enable_expert_parallel", "bool", "ep"), ("enable_ep_weight_filter", "bool", "ep_weight_filter"),
           ("mamba_ssm_cache_dtype", "cache_dtype", "mamba_ssm_cache_dtype"))
_STAGE1 = (("gpu_memory_utilization", "share", "dac_gpu_memory_utilization"),)
_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The DAC decoder's dtype names, as the deploy file may spell them.
_DAC_DTYPES = {"fp16": "float16", "float16": "float16", "half": "float16", "bf16": "bfloat16",
               "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32", "": "float32"}


def _stage_setting(value, kind: str, where: str, field: str):
    if kind == "int":
        return integer(value, where, field, 1, 1 << 30)
    if kind == "share":
        return number(value, where, field, 0.0, 1.0)
    if kind == "bool" and not isinstance(value, bool):
        raise _bad(where, field, f"is {_what(value)}; it must be true or false")
    if kind == "cache_dtype" and value not in _CACHE_DTYPES:
        raise _bad(where, field, f"is {value!r}; it must be one of {', '.join(_CACHE_DTYPES)}")
    return value


def check_deploy(data, name: str) -> dict:
    """The plan options a deploy config sets (stage 0's, stage 1's memory share, the DAC dtype),
    after checking its structure and every value the plan reads; one line on the first fault."""
    where = f"--deploy {name}"
    data = mapping(data, where, "the top level", required=True)
    stages = data.get("stages")
    if stages is not None and not isinstance(stages, list):
        raise _bad(where, "stages", f"is {_what(stages)}; it must be a list of stages")
    out, seen = {}, set()
    for i, stage in enumerate(stages or []):
        stage = mapping(stage, where, f"stages[{i}]", required=True)
        sid = stage.get("stage_id")
        if sid is not None:
            integer(sid, where, f"stages[{i}].stage_id", 0, 1024)
        seen.add(sid)
        for key, kind, option in _STAGE0 if sid == 0 else _STAGE1 if sid == 1 else ():
            if stage.get(key) is not None:
                out[option] = _stage_setting(stage[key], kind, where, f"stage {sid} {key}")
    if 0 not in seen:
        raise InputError(f"{where}: no stage 0")
    connectors = mapping(data.get("connectors"), where, "connectors")
    for key, conn in connectors.items():
        conn = mapping(conn, where, f"connectors.{key}")
        extra = mapping(conn.get("extra"), where, f"connectors.{key}.extra")
        dac = extra.get("fish_speech_dac_dtype")
        if dac is None:
            continue
        field = f"connectors.{key}.extra.fish_speech_dac_dtype"
        if not isinstance(dac, str):
            raise _bad(where, field, f"is {_what(dac)}; it must be a dtype name")
        if dac.strip().lower() not in _DAC_DTYPES:
            raise _bad(where, field, f"is {dac!r}, not a dtype the DAC decoder takes")
        out["dac_dtype"] = _DAC_DTYPES[dac.strip().lower()]
    return out


def _what(value) -> str:
    if value is None:
        return "missing (null)"
    kind = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(type(value))
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if kind in ("a mapping", "a list"):
        return kind
    return f"{kind or type(value).__name__} ({shown})"


def check_options(args) -> str | None:
    """Why the numeric options cannot be planned with (NaN, infinite, negative), or None."""
    for flag, value, low_open in (("--card-gib", args.card_gib, True), ("--reserve-gib", args.reserve_gib, False)):
        if value is None:
            continue
        if not math.isfinite(value) or value < 0 or (low_open and value == 0):
            return f"{flag} must be a finite number of GiB {'above' if low_open else 'at least'} 0, got {value:g}"
    return None
