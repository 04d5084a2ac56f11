"""``drama3-patches plan CHECKPOINT_DIR``: will the model fit, per card, before you try."""

from __future__ import annotations

import json
import sys

# Stage-0 settings a deploy file gives, by option; explicit options win.
_DEPLOY_DEFAULTS = {"tp": 1, "ep": False, "max_num_seqs": 64, "max_model_len": 16384,
                    "gpu_memory_utilization": 0.9, "mamba_ssm_cache_dtype": "auto",
                    "max_num_batched_tokens": 4096, "dac_gpu_memory_utilization": 0.1, "dac_dtype": "float32",
                    "ep_weight_filter": False, "tower_split": True}


def register(sub) -> None:
    import argparse

    p = sub.add_parser(
        "plan",
        help="per-card memory plan from config.json, safetensors headers and codec.pth (no tensor data is read)",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    p.add_argument("--card", help="card name: 910b1, 910b2, 910b3 (64 GiB), 910b4 (32 GiB), 950pr, 950dt")
    p.add_argument("--card-gib", type=float, help="card memory in GiB (another card, or to override)")
    p.add_argument("--mxfp8", action=argparse.BooleanOptionalAction, default=None,
                   help="the card keeps FP8 experts in FP8 (MXFP8); default: from the card table")
    p.add_argument("--deploy", metavar="PROFILE|FILE",
                   help="take the stage settings (TP, EP, max_num_seqs, max_model_len, memory shares, "
                        "mamba_ssm_cache_dtype, DAC dtype) from a shipped profile or a deploy YAML; "
                        "the options below override it")
    p.add_argument("--tp", type=int, help="tensor parallel size (default 1)")
    p.add_argument("--ep", action=argparse.BooleanOptionalAction, default=None,
                   help="expert parallel across the TP cards")
    p.add_argument("--ep-weight-filter", action=argparse.BooleanOptionalAction, default=None,
                   help="with EP, each rank reads only its own experts from disk (vLLM's enable_ep_weight_filter)")
    p.add_argument("--tower-split", action=argparse.BooleanOptionalAction, default=None,
                   help="fish_omni at TP > 1: the codebook tower's heads per rank (patch fish-omni-tower-tp-split; "
                        "default on), or --no-tower-split for the published whole tower on every card")
    p.add_argument("--max-num-seqs", type=int, help="default 64")
    p.add_argument("--max-model-len", type=int, help="default 16384")
    p.add_argument("--max-num-batched-tokens", type=int, help="default 4096 (fish_omni's input-embedding buffer)")
    p.add_argument("--gpu-memory-utilization", type=float, help="stage 0's share of a card (default 0.9)")
    p.add_argument("--mamba-ssm-cache-dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   help="gated-delta-net temporal state dtype (default auto: the model dtype)")
    p.add_argument("--dac-gpu-memory-utilization", type=float,
                   help="the DAC stage's share of the card it shares with stage 0 (default 0.1, as published)")
    p.add_argument("--dac-dtype", choices=("float32", "float16", "bfloat16"),
                   help="the DAC decoder's dtype (default float32, fish_speech_dac_dtype's default)")
    p.add_argument("--reserve-gib", type=float, default=2.0,
                   help="activations, workspace and communication buffers per card (estimate; default 2)")
    p.add_argument("--config-section", metavar="KEY[.KEY]",
                   help="for a config.json that is not fish_omni: the section of the language model (default: "
                        "the top level, else the first nested section with num_hidden_layers and hidden_size, "
                        "text_config first)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON (bytes)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines on standard error")
    from drama3_patches.tools.plan import timecli

    timecli.add_arguments(p)
    p.set_defaults(func=run)


class DeployError(ValueError):
    pass


def deploy_settings(name_or_path: str) -> dict:
    """Plan options from a deploy config (a profile name or a file): stage 0's, stage 1's memory
    share, the DAC dtype."""
    import os

    import yaml

    from drama3_patches.tools.deploy_config.profiles import PROFILES, profile_text
    from drama3_patches.tools.plan.inputs import check_deploy, load_yaml

    try:
        if name_or_path in PROFILES:
            data = yaml.safe_load(profile_text(name_or_path))
        elif os.path.exists(name_or_path):
            data = load_yaml(name_or_path)  # a regular file of bounded size and depth, or one line
        else:
            raise DeployError(f"--deploy {name_or_path}: neither a profile ({', '.join(sorted(PROFILES))}) "
                              "nor a file")
    except yaml.YAMLError as exc:
        raise DeployError(f"--deploy {name_or_path}: not valid YAML ({exc})") from None
    return check_deploy(data, name_or_path)  # every check of the file's values is there


def _progress(args):
    if args.quiet:
        return lambda message: None

    def say(message: str) -> None:
        print(f"drama3-patches plan: {message}", file=sys.stderr, flush=True)

    return say


def run(args) -> int:
    from drama3_patches.tools.files import InputError
    from drama3_patches.tools.plan.cards import UnknownCard, lookup
    from drama3_patches.tools.plan.model import (Options, PlanError, checkpoint_sums, load_checkpoint, make_plan,
                                                 smallest_fit)
    from drama3_patches.tools.report import format_bytes, table

    def fail(msg: str, code: int = 2) -> int:
        print(f"drama3-patches plan: {msg}", file=sys.stderr)
        return code

    from drama3_patches.tools.plan.inputs import check_options

    from drama3_patches.tools.plan import timecli

    bad = check_options(args) or (timecli.check(args) if args.time else None)
    if bad:
        return fail(bad)
    try:
        card = lookup(args.card, args.card_gib, args.mxfp8)
    except UnknownCard as exc:
        return fail(str(exc))
    settings = dict(_DEPLOY_DEFAULTS)
    if args.deploy:
        try:
            settings.update(deploy_settings(args.deploy))
        except (DeployError, InputError) as exc:
            return fail(str(exc))
    for key in _DEPLOY_DEFAULTS:
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if settings["tp"] < 1 or settings["max_num_seqs"] < 1 or settings["max_model_len"] < 1:
        return fail("--tp, --max-num-seqs and --max-model-len must be at least 1")
    for key in ("gpu_memory_utilization", "dac_gpu_memory_utilization"):
        if not 0 < settings[key] <= 1:
            return fail(f"--{key.replace('_', '-')} must be in (0, 1]")
    progress = _progress(args)
    try:
        ckpt = load_checkpoint(args.checkpoint, args.config_section, progress=progress)
        opts = Options(card=card, reserve_gib=args.reserve_gib, **settings)
        plan = make_plan(ckpt, opts)
        fit = smallest_fit(ckpt, opts)
        timed = timecli.compute(args, ckpt, plan, checkpoint_sums(ckpt)) if args.time else None
    except (PlanError, InputError, timecli.calibrate.FitError) as exc:
        return fail(str(exc))

    f, s = plan.figures, plan.shape
    if args.json:
        print(json.dumps({
            "card": {"name": card.name, "memory_gib": card.memory_gib, "mxfp8": card.mxfp8},
            "tp": opts.tp, "ep": opts.ep, "max_num_seqs": opts.max_num_seqs, "max_model_len": opts.max_model_len,
            "gpu_memory_utilization": opts.gpu_memory_utilization,
            "mamba_ssm_cache_dtype": opts.mamba_ssm_cache_dtype, "figures": f, "fits": plan.fits,
            "problems": plan.problems, "notes": plan.notes, "smallest_fit": [{"tp": t, "ep": e} for t, e in fit],
            "config_section": ckpt.text_section, "config_source": ckpt.config_source, "model_type": ckpt.kind,
            "files": ckpt.files, "tensors": len(ckpt.tensors),
            "codec_tensors": None if ckpt.codec is None else len(ckpt.codec),
            **({"time": timed} if timed else {}),
        }, indent=2, default=str))
        return 0 if plan.fits else 1

    note = f" ({card.note})" if card.note else ""
    codec = f"; {len(ckpt.codec)} tensors in codec.pth" if ckpt.codec is not None else ""
    print(f"checkpoint: {ckpt.path}: {len(ckpt.files)} safetensors file(s), {len(ckpt.tensors)} tensors{codec} "
          "(shapes and dtypes only; no tensor data read)")
    tower = ""
    if s.tower:
        tower = f"; codebook tower {s.tower.num_layers} layers, {s.tower.num_codebooks} codebooks"
    source = "" if ckpt.kind != "fish_omni" else f", {ckpt.config_source}"
    print(f"model: {s.num_layers} layers ({s.num_full} full attention, {s.num_linear} linear attention), "
          f"{s.num_experts} routed experts, hidden {s.hidden_size}{tower} (config: {ckpt.text_section}{source})")
    print(f"card: {card.name}, {card.memory_gib:g} GiB, {'MXFP8' if card.mxfp8 else 'no MXFP8'}{note}; "
          f"TP {opts.tp}, EP {'on' if opts.ep else 'off'}; gpu_memory_utilization {opts.gpu_memory_utilization:g}; "
          f"max_num_seqs {opts.max_num_seqs}, max_model_len {opts.max_model_len}")
    print()
    print("per card" + (" (stage 0: backbone, codebook tower, DAC encoder)" if s.tower else ""))
    rows = [("dense weights after sharding", f["dense"])]
    if s.tower:
        rows += [(f"lm_head rows kept ({s.tower.head_rows} of {s.vocab_size})", f["head"]),
                 (f"codebook tower ({s.tower.num_layers} layers, "
                  + (f"attention heads split over TP {opts.tp}, " if f["tower_split"] else "replicated, ")
                  + "code tables folded)", f["tower"]),
                 ("DAC encoder for reference audio (float32)", f["dac_encoder"]),
                 ("model buffers (code history, input embeddings)", f["model_buffers"])]
    rows += [
        ("read from disk per rank (safetensors; "
         + ("other ranks' experts skipped)" if f["disk_read_filtered"] else "every expert)"), f["disk_read_per_rank"]),
        ("routed experts as stored (FP8 + scales)", f["experts_stored"]),
        ("routed experts after bfloat16 expansion", f["experts_bf16"]),
        (f"weights resident (experts {f['expert_mode']})", f["resident"]),
    ]
    if f["expert_mode"].startswith("expanded"):
        rows += [("transient load peak (patched: host expansion, per layer)", f["load_peak"]),
                 ("transient load peak, unpatched (FP8 + device transpose)", f["load_peak_unpatched"])]
    else:
        rows += [("transient load peak (one layer staged)", f["load_peak"])]
    rows += [
        (f"stage budget ({opts.gpu_memory_utilization:g} x {card.memory_gib:g} GiB)", f["budget"]),
        ("reserve: activations, workspace (estimate)", f["reserve"]),
        ("left for KV cache + linear-attention state", f["left_for_cache"]),
        (f"needed for {opts.max_num_seqs} seqs x {opts.max_model_len} tokens", f["cache_needed"]),
    ]
    print(table([[label, format_bytes(value)] for label, value in rows], indent="  "))
    tower_kv = (f" (codebook tower {f['kv_per_token_tower']}, {f['tower_kv_heads']} KV head(s) per card)"
                if s.tower else "")
    ssm = "" if opts.mamba_ssm_cache_dtype == "auto" else f", temporal state {opts.mamba_ssm_cache_dtype}"
    print(f"  (KV {f['kv_per_token']} B/token{tower_kv}, linear-attention state {f['state_per_seq']} B/sequence{ssm})")
    routes = f.get("fp8_routes")
    if routes:
        print(f"  FP8 expert load route: native (vLLM-Ascend's method) peak {format_bytes(routes['native']).strip()} "
              f"({routes['native_at']}); cpu (host expansion) peak {format_bytes(routes['cpu']).strip()}, "
              f"host holds {format_bytes(routes['cpu_host']).strip()}")
        print(f"  route taken: {routes['route']}: {routes['why']}")
    if f["dense_fp8"]:
        print(f"  note: {f['dense_fp8'] / 1024 ** 3:.2f} GiB of dense FP8 tensors counted as stored")
    if "dac_weights" in f:
        print()
        print("DAC stage (stage 1, on a card it shares with stage 0)")
        print(table([[label, format_bytes(value)] for label, value in (
            (f"DAC decoder weights ({opts.dac_dtype}, weight norms baked)", f["dac_weights"]),
            (f"stage budget ({opts.dac_gpu_memory_utilization:g} x {card.memory_gib:g} GiB)", f["dac_budget"]),
            ("left for decoding", f["dac_left"]),
        )], indent="  "))
    elif ckpt.codec_note:
        print(f"  note: {ckpt.codec_note}")
    for line in plan.notes:
        print(f"note: {line}")
    print()
    if plan.fits:
        peak = routes[routes["route"]] if routes else f["load_peak"]  # the route the deploy takes
        print(f"verdict: FITS: load peak {peak / 1024 ** 3:.2f} GiB of {f['budget'] / 1024 ** 3:.2f} GiB; "
              f"{f['left_for_cache'] / 1024 ** 3:.2f} GiB left for {f['cache_needed'] / 1024 ** 3:.2f} GiB of cache")
    else:
        print("verdict: DOES NOT FIT: " + "; ".join(plan.problems))
    if fit:
        tp = fit[0][0]
        how = " or ".join("with EP" if ep else "without EP" for _, ep in fit) if tp > 1 else ""
        print(f"smallest that fits: TP {tp}" + (f" ({how})" if how else ""))
    else:
        print("smallest that fits: none up to TP 16 with these settings")
    if timed:
        timecli.print_text(timed)
    return 0 if plan.fits else 1
