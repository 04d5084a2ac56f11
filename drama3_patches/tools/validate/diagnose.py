"""Known failure signatures of a Drama 3 deployment, and what each means: the cause and the fix.

:class:`Matcher` is fed the server's log line by line (``logscan``) and keeps the first line that
showed each signature. When a row fails, ``report.md`` names the first failing row and, where
the log matched a signature, the likely cause and the fix, so that a failed hour on the cards
leaves what is needed to mend it without a second booking.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CONTEXT_LINES = 60  # lines before a match that a signature's context may look at (the same process's only)
_PID = re.compile(r"\(\S+ pid=(\d+)\)")  # the log prefix vLLM gives each process's lines


@dataclass(frozen=True)
class Signature:
    name: str
    pattern: re.Pattern
    cause: str
    fix: str
    context: re.Pattern | None = None  # must also match the line or one of the lines just before it
    generic: bool = False  # a consequence of other failures: named only when nothing specific was found
    excludes: tuple = ()  # signatures a match of this one makes redundant on the same line
    # (what the run already uses, as a predicate of its facts; the fix to give instead): a fix never
    # names what the run already does
    in_use: tuple = ()


def _re(text: str, flags: int = 0) -> re.Pattern:
    return re.compile(text, flags)


_EXPERTS = _re(r"fused_moe|FusedMoE|process_weights_after_loading|expert|w13_weight|w2_weight|fp8|"
               r"transpose|expand", re.IGNORECASE)
_OOM = r"NPU out of memory|out of memory|OutOfMemoryError"
_PATCHES_ON = (("patches_on", "DRAMA3_PATCHES was on for this run, so the patches did not activate in the server's "
                              "processes: run `drama3-patches status --import-targets` with the server's Python (the "
                              ".pth line or vLLM's plugin entry point is missing there) and check "
                              "DRAMA3_PATCHES_DISABLE"),)

SIGNATURES = (
    Signature(
        "tensor parallel refused",
        _re(r"fish_omni runs with one tensor and pipeline rank"),
        "the published fish_omni refused stage 0's tensor parallel size: the patches were not on in the "
        "server's processes (fish-omni-tensor-parallel lifts that check)",
        "export DRAMA3_PATCHES=1 in the shell that runs validate (the server inherits it); "
        "`drama3-patches status --import-targets` there must show fish-omni-tensor-parallel pending or applied",
        in_use=_PATCHES_ON),
    Signature(
        "model runner v2 refused",
        _re(r"Model Runner V2 is not supported"),
        "vLLM-Omni refused Model Runner V2 on the NPU: runner-selection did not apply in the process that "
        "read the deploy file",
        "export DRAMA3_PATCHES=1 before validate, and check runner-selection in the API server's report "
        "(row e, or `drama3-patches status --collect REPORTS`)",
        in_use=_PATCHES_ON),
    Signature(
        "fp8 copy on the card",
        _re(r"561103"),
        "an in-place copy of block-FP8 expert weights on the card failed (aclnnInplaceCopy 561103: the 910B "
        "has no FP8 copy): the experts reached the device without the CPU expansion",
        "fp8-expert-method must be applied in every stage-0 worker (row e); check DRAMA3_PATCHES=1, "
        "DRAMA3_PATCHES_DISABLE, and the vllm-ascend pairing with `drama3-patches doctor`",
        context=_re(r"aclnnInplaceCopy")),
    Signature(
        "out of memory at expert load",
        _re(_OOM, re.IGNORECASE),
        "the card ran out of memory while the routed experts were expanded to bfloat16 or transposed at load "
        "(one 64 GB 910B cannot hold Drama 3 with bfloat16 experts)",
        "serve stage 0 at tensor parallel 2 with expert parallel (profile 910b-tp2-ep); "
        "`drama3-patches plan CHECKPOINT --card 910b1 --deploy 910b-tp2-ep` gives each card's share; "
        "`npu-smi info` shows other processes holding the cards",
        context=_EXPERTS, excludes=("out of memory",),
        in_use=(("tp2_ep", "stage 0 already runs at tensor parallel 2 with expert parallel: free the cards "
                           "(`npu-smi info` shows other processes holding them), lower stage 0's "
                           "gpu_memory_utilization so the load has room, and check each card's share with "
                           "`drama3-patches plan CHECKPOINT --card 910b1 --deploy 910b-tp2-ep`"),)),
    Signature(
        "out of memory",
        _re(_OOM, re.IGNORECASE),
        "a card ran out of memory after the weights loaded (KV cache, activations or the DAC stage)",
        "lower the stage's gpu_memory_utilization, max_num_seqs or max_model_len in the deploy file; "
        "`drama3-patches plan` sizes both stages per card; `npu-smi info` for other processes"),
    Signature(
        "collective timeout",
        _re(r"\b(HCCL|hccl|NCCL|nccl|gloo|Gloo)\b.*\b(timeout|timed out|time out)\b|"
            r"Watchdog caught collective operation timeout|collective operation timeout|DistBackendError"),
        "a collective between the tensor-parallel ranks did not complete: one rank died or hung, or the "
        "cards cannot reach each other",
        "find the other rank's first error above this line; check both cards with `npu-smi info`, "
        "ASCEND_RT_VISIBLE_DEVICES, and HCCL_CONNECT_TIMEOUT / HCCL_EXEC_TIMEOUT"),
    Signature(
        "ranks drifted",
        _re(r"TensorParallelDrift: "),  # the exception's own line, not the traceback's source line
        "the tensor-parallel ranks sampled different frames for the same step (fish-omni-tp-frames-check)",
        "report it with this line and report.json: the ranks' all-reduce is not bit-identical here, or their "
        "noise differs; the run stopped before a listener could hear mixed frames"),
    Signature(
        "resumed history mismatch",
        _re(r"ResumedHistoryMismatch: "),
        "a preempted request resumed with frames other than those it generated (preemption-host-copy's "
        "resume check)",
        "report it with this line and report.json; until it is fixed, size stage 0's KV pool so that "
        "requests are not preempted"),
    Signature(
        "missing module",
        _re(r"ModuleNotFoundError: No module named"),
        "a module a server process imports is not installed",
        "install it; `drama3-patches doctor` checks the vLLM / vLLM-Omni / vLLM-Ascend / torch-npu pairing"),
    Signature(
        "a process died",
        _re(r"EngineDeadError|Engine core .*(died|failed)|died unexpectedly|exited unexpectedly|"
            r"WorkerProc hit an exception|Worker proc .* died|initialization failed", re.IGNORECASE),
        "a process of the deployment (an engine core or a worker) died",
        "its own error is the first traceback in server.log above this line; a process killed without one "
        "was likely the kernel's OOM killer (`dmesg | grep -i -E 'killed process|out of memory'`)",
        generic=True),
)


@dataclass
class Found:
    signature: Signature
    line: str
    at: int  # line number in the log (1-based)
    count: int = 1


class Matcher:
    """The first line of each signature seen, and how often each was seen."""

    def __init__(self, signatures=SIGNATURES) -> None:
        self.signatures = signatures
        self.found: dict[str, Found] = {}
        self.lines = 0

    def feed(self, line: str, recent=None) -> None:
        """``recent``: the lines just before (and including) ``line``, for signatures with a context
        (read: those of ``line``'s own process)."""
        self.lines += 1
        skip: set = set()
        for sig in self.signatures:
            if sig.name in skip or not sig.pattern.search(line):
                continue
            if sig.context is not None and not _in_context(sig.context, line, recent):
                continue
            seen = self.found.get(sig.name)
            if seen is None:
                self.found[sig.name] = Found(sig, line.strip()[:400], self.lines)
            else:
                seen.count += 1
            skip.update(sig.excludes)

    def likely(self) -> Found | None:
        """The likely cause: the first specific signature the log showed, else the generic one."""
        specific = [f for f in self.found.values() if not f.signature.generic]
        pool = specific or list(self.found.values())
        return min(pool, key=lambda f: f.at) if pool else None

    def all(self) -> list[Found]:
        return sorted(self.found.values(), key=lambda f: f.at)


def _process(line: str) -> str | None:
    """The pid a line's prefix names (None: an unprefixed line)."""
    m = _PID.search(line)
    return m.group(1) if m else None


def _in_context(context: re.Pattern, line: str, recent) -> bool:
    if context.search(line):
        return True
    if not recent:
        return False
    mine = _process(line)
    lines = list(recent)[-CONTEXT_LINES:]
    return any(context.search(other) for other in lines if _process(other) == mine)


def fix_for(sig: Signature, facts: dict | None) -> str:
    """``sig``'s fix, or what to do instead where the run already does what the fix names."""
    for fact, instead in sig.in_use:
        if (facts or {}).get(fact):
            return instead
    return sig.fix


def run_facts(tp: int, ep: bool) -> dict:
    """What a fix may name that the run already uses: stage 0 at TP2 with expert parallel, the
    patches switched on in the environment the server inherited."""
    from drama3_patches import env

    return {"tp2_ep": tp >= 2 and ep, "patches_on": env.enabled()}


def explain(first_failed, matcher: Matcher, facts: dict | None = None) -> list[str]:
    """The diagnosis lines of ``report.md``: the first failing row, the likely cause and fix (one
    that changes something the run does: ``facts``, :func:`run_facts`), and every signature the
    log showed."""
    if first_failed is None:
        return []
    out = [f"First failing row: **{first_failed.name}**: {first_failed.detail.replace('|', '/')[:600]}"]
    likely = matcher.likely()
    if likely is None:
        out.append("No known failure signature in server.log; its last lines are in diagnosis.txt.")
        return out
    sig = likely.signature
    out += [f"Likely cause ({sig.name}, server.log line {likely.at}): {sig.cause}.", f"Fix: {fix_for(sig, facts)}.",
            f"The line: `{likely.line.replace('`', chr(39))}`"]
    others = [f for f in matcher.all() if f is not likely]
    if others:
        out.append("Also in the log: " + "; ".join(f"{f.signature.name} (line {f.at}, {f.count}x)" for f in others))
    return out
