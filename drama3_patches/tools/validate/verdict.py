"""The checks of a validation and its report (``report.json``, ``report.md``).

Each phase adds its check as it ends; a phase that could not run (the server never became ready)
is a failed check saying so, never a pass. ``report.json`` keeps ``passed``, ``checks`` (``name``,
``passed``, ``detail``), ``counts``, the versions and the profile.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

VERSIONED = ("vllm", "vllm-ascend", "vllm-omni", "torch", "torch-npu", "drama3-patches")


@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    applicable: bool = True
    wall_s: float | None = None


STREAM_MARGIN_S = 0.010  # row b: a clone's first audio must arrive this long before its last chunk
# The codec's first window: vLLM-Omni's fish_omni.yaml and every shipped profile have codec_chunk_ramp
# "6,8,12,16,24,32", so stage 1 sends a clone's first 6 frames as one chunk.
FIRST_WINDOW_FRAMES = 6
FRAME_SAMPLES = 2048


def streamed(chunks) -> bool:
    """Whether a clone's audio streamed: two chunks or more (``(arrival_s, audio_s)``), the first
    arriving at least :data:`STREAM_MARGIN_S` before the last (a response buffered whole and sent
    at once arrives in pieces within a millisecond or so)."""
    return len(chunks) >= 2 and chunks[-1][0] - chunks[0][0] >= STREAM_MARGIN_S


@dataclass
class Run:
    profile: str
    model: str
    tp: int
    ep: bool
    compiled: bool
    scale: object
    notes: list = field(default_factory=list)
    checks: dict = field(default_factory=dict)  # phase letter -> Check
    # every request validate sends is a voice clone, so one count says both
    counts: dict = field(default_factory=lambda: dict.fromkeys(
        ("requests_completed", "preemptions", "resumes", "resumes_verified", "tp_steps_checked"), 0))
    bench_levels: list = field(default_factory=list)
    audio: list = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    wall_s: float = 0.0
    ready: bool = False  # the server answered
    processes: list = field(default_factory=list)  # each process report of the run, with its role
    ended: str = "completed"  # or how the run was cut short ("interrupted by SIGTERM", ...)
    stopped: dict = field(default_factory=dict)  # what stopping the server took (server.Server.stop)
    diagnosis: list = field(default_factory=list)  # report.md's lines on the first failing row
    facts: dict = field(default_factory=dict)  # host facts summary (facts.collect); whole in host-facts.md
    frame_time: dict | None = None  # profile.measure's figures, when profiled
    capture_platform: bool | None = None  # whether vLLM captures graphs here (not on its CPU build); None: ask

    # -- phases --------------------------------------------------------------------------------

    def startup(self, ready: bool, waited: float, why: str, graphs: dict) -> None:
        """``graphs``: stage 0's capture records per worker and its compile records
        (``logscan.LogScan.stage0_graphs``). A graph profile passes only with a capture record from
        each stage-0 worker; compiling is not capturing. Where the platform captures nothing
        (vLLM's CPU build), a compiled stage 0 is said to be compiled, not captured."""
        self.ready = ready
        if not ready:
            self.checks["a"] = Check("a. start-up", False, f"{why} ({waited:.0f} s); see server.log", wall_s=waited)
            return
        head = f"ready in {waited:.0f} s"
        captures, compiles = graphs.get("captures", {}), graphs.get("compiles", 0)
        if not self.compiled:
            ok, detail = True, f"{head}; stage 0 eager (enforce_eager): no graph capture"
        elif not self._captures_graphs():
            ok = compiles > 0
            detail = (f"{head}; stage 0 compiled ({compiles} compile record(s)); capture not available on this "
                      "platform" if ok else f"{head}, but stage 0 should compile and logged no compile record")
        else:
            missing = [role for role, n in captures.items() if n == 0]
            ok = bool(captures) and not missing
            if ok:
                detail = (f"{head}; stage 0 captured graphs on each of its {len(captures)} worker(s) "
                          f"({sum(captures.values())} capture record(s)), {compiles} compile record(s)")
            elif not captures:
                detail = f"{head}, but no stage-0 worker was found in the log to have captured a graph"
            elif len(missing) == len(captures):
                detail = (f"{head}; stage 0 compiled but captured no graph ({compiles} compile record(s), "
                          "no capture record)" if compiles else
                          f"{head}, but stage 0 captured no graph (no capture record from its workers)")
            else:
                detail = (f"{head}, but stage 0 captured graphs on {len(captures) - len(missing)} of "
                          f"{len(captures)} workers: {', '.join(missing)} logged no capture record")
        self.checks["a"] = Check("a. start-up", ok, detail, wall_s=waited)

    def _captures_graphs(self) -> bool:
        if self.capture_platform is None:
            from drama3_patches.platform import current_platform

            self.capture_platform = current_platform() != "cpu"
        return self.capture_platform

    def clones(self, phase, audio: list) -> None:
        self.audio += audio
        problems, n = phase.problems, len(phase.sent)
        overlaps = phase.overlaps()
        complete = [s for s in phase.sent if s.problem() is None]
        # a clone that ended within the codec's first window has one chunk to send, however it streams
        judged = [s for s in complete if s.samples // FRAME_SAMPLES > FIRST_WINDOW_FRAMES]
        whole = [s for s in judged if not streamed(s.result.chunks)]
        ok = not problems and (n == 1 or overlaps > 0) and bool(judged) and not whole
        detail = (f"{phase.completed}/{n} streamed clones complete in whole 44.1 kHz frames; {overlaps} arrived "
                  f"while an earlier one was streaming; chunks per clone: "
                  f"{', '.join(str(len(s.result.chunks)) for s in complete) or '-'}")
        if len(judged) < len(complete):
            detail += (f"; {len(complete) - len(judged)} ended within the first {FIRST_WINDOW_FRAMES}-frame window "
                       "(not judged for streaming)")
        if complete and not judged:
            detail += "; no clone ran past the first window, so none shows it streamed: raise --clone-frames"
        if whole:
            detail += (f"; {len(whole)} of {len(judged)} clones arrived in one piece (fewer than 2 chunks, or "
                       f"the first audio less than {STREAM_MARGIN_S * 1e3:.0f} ms before the last chunk)")
        if problems:
            detail += "; " + "; ".join(problems[:4])
        elif not ok and not whole and judged:
            detail += ": none overlapped, lower --stagger"
        self._served(phase)
        self.checks["b"] = Check("b. streaming voice clones", ok, detail, wall_s=phase.wall_s)

    def preemption(self, phase, before: dict, after: dict, audio: list) -> None:
        self.audio += audio
        d = {k: after[k] - before[k] for k in after}
        for key in ("preemptions", "resumes", "resumes_verified"):
            self.counts[key] = d[key]
        problems = phase.problems
        why = []
        if d["preemptions"] < 1:
            why.append(f"nothing was preempted: the requests must outgrow a KV block while the pool is full; "
                       f"raise --preempt-frames or lower --kv-blocks (now {self.scale.kv_blocks})")
        elif d["resumes"] < 1:
            why.append("no preempted request resumed with generated frames: raise --preempt-frames")
        if d["resumes_verified"] != d["resumes"]:
            why.append(f"{d['resumes'] - d['resumes_verified']} of {d['resumes']} resumes not verified (a "
                       "mismatch stops the engine: see row f; else the check is off in the workers)")
        ok = not problems and not why
        detail = (f"{phase.completed}/{len(phase.sent)} requests complete; {d['preemptions']} preemption(s), "
                  f"{d['resumes']} resume(s) with frames, {d['resumes_verified']} history verified by content")
        detail += "".join(f"; {w}" for w in why + problems[:4])
        self._served(phase)
        self.checks["c"] = Check("c. preemption and resume", ok, detail, wall_s=phase.wall_s)

    def bench(self, levels: list, wall_s: float, require_stall_free: float | None = None) -> None:
        from drama3_patches.tools.bench import playout

        self.bench_levels = levels
        self.counts["requests_completed"] += sum(lv["completed"] for lv in levels)
        failed = [f"{f['utt']}: {f['error']}" for lv in levels for f in lv["failures"]]
        parts = [f"c{lv['max_concurrency']}: TTFA p50 {_ms(lv['median_ttft_ms'])}, "
                 f"{_num(lv['audio_throughput'])} audio s/s, RTF {_num(lv['mean_rtf'])}, "
                 f"{playout.summary(lv.get('playout'))}" for lv in levels]
        stalled = playout.not_stall_free(levels, require_stall_free)
        detail = "; ".join(parts) + ("; failed: " + "; ".join(failed[:4]) if failed else "") + \
            ("; " + "; ".join(stalled[:4]) if stalled else "")
        self.checks["g"] = Check("g. bench", not failed and not stalled, detail, wall_s=wall_s)

    def final(self, counts: dict, procs: list, skipped: list, scan,
              not_run: str = "the server never became ready") -> None:
        """The rows judged on what the whole run left: counts, process reports, the log (``scan``:
        a ``logscan.LogScan`` read up to the stop)."""
        from drama3_patches.tools.validate import evidence

        self.counts["tp_steps_checked"] = counts["tp_steps_checked"]
        for letter, name in (("a", "a. start-up"), ("b", "b. streaming voice clones"),
                             ("c", "c. preemption and resume"), ("g", "g. bench")):
            if letter not in self.checks:
                self.checks[letter] = Check(name, False, f"not run: {not_run}")
        if self.tp > 1:
            ok = counts["tp_steps_checked"] > 0 and not scan.drift
            detail = (f"{counts['tp_steps_checked']} step(s) compared across {self.tp} ranks"
                      + ("; TensorParallelDrift in the log" if scan.drift else "")
                      + ("" if counts["tp_steps_checked"] else ": no step was compared"))
            self.checks["d"] = Check("d. rank agreement", ok, detail)
        else:
            self.checks["d"] = Check("d. rank agreement", True, "not applicable: stage 0 at TP1", applicable=False)
        ok, problems = evidence.patch_table(procs, self.tp)
        table = "; ".join(f"pid {p.pid} {p.role}: {sum(s == 'applied' for s in p.states.values())} applied"
                          for p in procs)
        detail = (f"{len(procs)} process report(s)" + (f" ({table})" if table else "")
                  + ("" if ok else "; " + "; ".join(problems[:6])) + ("; skipped: " + "; ".join(skipped[:3])
                                                                     if skipped else ""))
        self.checks["e"] = Check("e. patch states", ok, detail)
        self.processes = [{"pid": p.pid, "role": p.role, "enabled": p.enabled, "states": p.states,
                           "counts": p.counts} for p in procs]
        from drama3_patches.tools.validate.logscan import SERVER_LOG_LEVEL, is_stage0

        count, shown = scan.bad_count, scan.bad_shown
        silent = [f"{p.role} (pid {p.pid}) logged nothing" for p in procs
                  if is_stage0(p.role) and not scan.records.get(p.pid)]
        heard = sum(1 for p in procs if is_stage0(p.role) and scan.records.get(p.pid))
        detail = "no device, collective or traceback line" if not count else \
            f"{count} line(s): " + " | ".join(shown)
        detail += (f"; records from {heard} stage-0 process(es) (served at VLLM_LOGGING_LEVEL={SERVER_LOG_LEVEL}, "
                   "whatever the shell sets)")
        if not heard and not silent:
            silent = ["no stage-0 process is known from its report, so none was heard"]
        detail += "".join(f"; {s}" for s in silent)
        self.checks["f"] = Check("f. server log", count == 0 and not silent and self.ready,
                                 detail if self.ready else f"the server did not start; {detail}")

    def diagnose(self, matcher) -> None:
        """report.md's diagnosis: the first failing row and, from the log's signatures, the likely
        cause and its fix (``diagnose.explain``)."""
        from drama3_patches.tools.validate import diagnose

        self.diagnosis = diagnose.explain(self.first_failed, matcher, diagnose.run_facts(self.tp, self.ep))

    def _served(self, phase) -> None:
        self.counts["requests_completed"] += phase.completed

    # -- the report ----------------------------------------------------------------------------

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks.values())

    def ordered(self) -> list[Check]:
        return [self.checks[k] for k in sorted(self.checks)]

    @property
    def first_failed(self) -> Check | None:
        return next((c for c in self.ordered() if not c.passed), None)

    def json(self) -> str:
        return json.dumps({
            "passed": self.passed,
            "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail, "applicable": c.applicable,
                        "wall_s": c.wall_s} for c in self.ordered()],
            "counts": self.counts,
            "profile": self.profile, "model": self.model,
            "stage0": {"tensor_parallel_size": self.tp, "expert_parallel": self.ep, "compiled": self.compiled,
                       "kv_blocks": self.scale.kv_blocks, "max_model_len": self.scale.max_model_len},
            "versions": self.versions, "bench": self.bench_levels, "processes": self.processes,
            "audio": self.audio, "notes": self.notes, "wall_s": self.wall_s, "ended": self.ended,
            "first_failed": self.first_failed.name if self.first_failed else None,
            "diagnosis": self.diagnosis, "server_stop": self.stopped, "facts": self.facts,
            "frame_time": self.frame_time,
        }, indent=1, default=str)

    def markdown(self) -> str:
        head = [f"## drama3-patches validate: {'PASSED' if self.passed else 'FAILED'}", "",
                f"Profile `{self.profile}`; stage 0 at TP{self.tp}, expert parallel {'on' if self.ep else 'off'}, "
                f"{'compiled' if self.compiled else 'eager'}; KV pool {self.scale.kv_blocks} blocks, "
                f"max_model_len {self.scale.max_model_len}; model `{self.model}`.",
                "Versions: " + ", ".join(f"{k} {v or '-'}" for k, v in self.versions.items()) + ".", "",
                "| check | result | detail | s |", "| --- | --- | --- | --- |"]
        for c in self.ordered():
            result = "n/a" if not c.applicable else ("pass" if c.passed else "**FAIL**")
            wall = "" if c.wall_s is None else f"{c.wall_s:.0f}"
            head.append(f"| {c.name} | {result} | {c.detail.replace('|', '/')} | {wall} |")
        n = self.counts
        head += ["",
                 "| requests completed (each a voice clone) | preemptions (c) | resumes (c) | resumes verified (c) "
                 "| TP steps checked |",
                 "| --- | --- | --- | --- | --- |",
                 f"| {n['requests_completed']} | {n['preemptions']} | {n['resumes']} | {n['resumes_verified']} | "
                 f"{n['tp_steps_checked']} |"]
        from drama3_patches.tools.validate import profile

        head += profile.markdown(self.frame_time)
        if self.diagnosis:
            head += ["", "### Diagnosis", ""] + self.diagnosis
        if self.ended != "completed":
            head += ["", f"The run was {self.ended}; rows that did not run are failures."]
        if self.stopped:
            left = self.stopped.get("left") or []
            head += ["", f"Server stopped: {self.stopped.get('terminated', 0)} process(es) ended on TERM, "
                         f"{self.stopped.get('killed', 0)} needed KILL"
                         + (f"; **{len(left)} still running** (pid {', '.join(map(str, left))})" if left else "")
                         + "."]
        if self.notes:
            head += ["", "Notes:"] + [f"- {line}" for line in self.notes]
        head += ["", f"Whole run {self.wall_s:.0f} s. Host facts for a bug report: host-facts.md."]
        return "\n".join(head) + "\n"

    def write(self, out) -> None:
        """``report.json`` and ``report.md`` in ``out`` (an ``outdir.OutFolder``), each replaced
        whole through the folder's descriptor (never half written, never through a link)."""
        for name, text in (("report.json", self.json()), ("report.md", self.markdown())):
            out.write(name, text)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _num(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def versions() -> dict:
    from drama3_patches.versions import installed_version

    return {d: installed_version(d) for d in VERSIONED}
