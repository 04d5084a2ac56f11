"""``drama3-patches plan CHECKPOINT_DIR``: will the model fit, per card, before you try."""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="per-card memory plan from config.json and safetensors headers (no tensor data is read)",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    p.add_argument("--card", help="card name: 910b1, 910b2, 910b3 (64 GiB), 910b4 (32 GiB), 950pr, 950dt")
    p.add_argument("--card-gib", type=float, help="card memory in GiB (another card, or to override)")
    p.add_argument("--mxfp8", action=argparse_bool(), default=None,
                   help="the card keeps FP8 experts in FP8 (MXFP8); default: from the card table")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    p.add_argument("--ep", action="store_true", help="expert parallel across the TP cards")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--reserve-gib", type=float, default=2.0,
                   help="activations, workspace and communication buffers per card (estimate; default 2)")
    p.add_argument("--config-section", metavar="KEY[.KEY]",
                   help="the config.json section of the language model (default: the top level, else the first "
                        "nested section with num_hidden_layers and hidden_size, text_config first)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON (bytes)")
    p.set_defaults(func=run)


def argparse_bool():
    import argparse

    return argparse.BooleanOptionalAction


def _gib(x: float) -> str:
    # MiB below 1 GiB, so small checkpoints and per-sequence figures do not print as 0.00.
    if abs(x) < 1024 ** 3:
        return f"{x / 1024 ** 2:8.2f} MiB"
    return f"{x / 1024 ** 3:8.2f} GiB"


def run(args) -> int:
    from drama3_patches.tools.plan.cards import UnknownCard, lookup
    from drama3_patches.tools.plan.model import Options, PlanError, load_checkpoint, make_plan, smallest_fit

    def fail(msg: str, code: int = 2) -> int:
        print(f"drama3-patches plan: {msg}", file=sys.stderr)
        return code

    try:
        card = lookup(args.card, args.card_gib, args.mxfp8)
    except UnknownCard as exc:
        return fail(str(exc))
    if args.tp < 1 or args.max_num_seqs < 1 or args.max_model_len < 1:
        return fail("--tp, --max-num-seqs and --max-model-len must be at least 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        return fail("--gpu-memory-utilization must be in (0, 1]")
    try:
        ckpt = load_checkpoint(args.checkpoint, args.config_section)
        opts = Options(card=card, tp=args.tp, ep=args.ep, max_num_seqs=args.max_num_seqs,
                       max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                       reserve_gib=args.reserve_gib)
        plan = make_plan(ckpt, opts)
        fit = smallest_fit(ckpt, opts)
    except PlanError as exc:
        return fail(str(exc))

    f, s = plan.figures, plan.shape
    if args.json:
        print(json.dumps({
            "card": {"name": card.name, "memory_gib": card.memory_gib, "mxfp8": card.mxfp8},
            "tp": opts.tp, "ep": opts.ep, "max_num_seqs": opts.max_num_seqs, "max_model_len": opts.max_model_len,
            "gpu_memory_utilization": opts.gpu_memory_utilization, "figures": f, "fits": plan.fits,
            "problems": plan.problems, "smallest_fit": [{"tp": t, "ep": e} for t, e in fit],
            "config_section": ckpt.text_section, "files": ckpt.files, "tensors": len(ckpt.tensors), "header_bytes_read": ckpt.header_bytes_read,
        }, indent=2))
        return 0 if plan.fits else 1

    note = f" ({card.note})" if card.note else ""
    print(f"checkpoint: {ckpt.path}: {len(ckpt.files)} safetensors file(s), {len(ckpt.tensors)} tensors, "
          f"{ckpt.header_bytes_read} header bytes read (no tensor data)")
    print(f"model: {s.num_layers} layers ({s.num_full} full attention, {s.num_linear} linear attention), "
          f"{s.num_experts} routed experts, hidden {s.hidden_size} (config: {ckpt.text_section})")
    print(f"card: {card.name}, {card.memory_gib:g} GiB, {'MXFP8' if card.mxfp8 else 'no MXFP8'}{note}; "
          f"TP {opts.tp}, EP {'on' if opts.ep else 'off'}; gpu_memory_utilization {opts.gpu_memory_utilization:g}; "
          f"max_num_seqs {opts.max_num_seqs}, max_model_len {opts.max_model_len}")
    print()
    print("per card")
    rows = [
        ("dense weights after sharding", f["dense"]),
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
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"  {label:<{width}}  {_gib(value)}")
    print(f"  (KV {f['kv_per_token']} B/token, linear-attention state {f['state_per_seq']} B/sequence)")
    if f["dense_fp8"]:
        print(f"  note: {f['dense_fp8'] / 1024 ** 3:.2f} GiB of dense FP8 tensors counted as stored")
    print()
    if plan.fits:
        print(f"verdict: FITS: load peak {f['load_peak'] / 1024 ** 3:.2f} GiB of {f['budget'] / 1024 ** 3:.2f} GiB; "
              f"{f['left_for_cache'] / 1024 ** 3:.2f} GiB left for {f['cache_needed'] / 1024 ** 3:.2f} GiB of cache")
    else:
        print("verdict: DOES NOT FIT: " + "; ".join(plan.problems))
    if fit:
        tp = fit[0][0]
        how = " or ".join("with EP" if ep else "without EP" for _, ep in fit) if tp > 1 else ""
        print(f"smallest that fits: TP {tp}" + (f" ({how})" if how else ""))
    else:
        print("smallest that fits: none up to TP 16 with these settings")
    return 0 if plan.fits else 1
