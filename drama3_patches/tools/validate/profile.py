"""Where a frame's time goes: stage 0 profiled by vLLM's own profiler for a window of decode steps.

The served deploy gives stage 0 a ``profiler_config`` (:func:`profiler_config`): vLLM's torch
profiler, writing into the report folder, off until asked. vLLM-Omni then serves
``/start_profile`` and ``/stop_profile`` (``entrypoints/serve/profile/utils.py``). After the
other phases, :func:`measure` starts it on stage 0, sends one request at concurrency 1, and
stops it; the profiler itself skips the first ``delay`` steps (the prefill, the first decode)
and records the next ones (``delay_iterations``, ``max_iterations``), so the window holds decode
steps only. Nothing else runs meanwhile, and no other phase runs under it.

The trace is a Chrome trace (``*.pt.trace.json.gz`` from vLLM's worker, ``trace_rank0.json.gz``
from vLLM-Omni's, ``trace_view.json`` from torch-npu's). :func:`attribute` reads rank 0's:

- a step is vLLM's per-step annotation (``execute_context_0(0)_generation_1(1)``, a
  ``record_function`` range the worker opens while a profiler runs); ``step_ms`` is the time
  from one decode step's start to the next's, the cadence at which stage 0 makes frames;
- ``backbone``: the Qwen3.5 model module; ``tower``: the codebook tower's layers and heads;
  ``sampler``: fish_omni's ``FusedFrameSampler`` calls; ``other``: the rest of the model's
  forward; ``outside_forward``: the step's annotated range and the worker's ``sample_tokens``
  outside the forward. These come from the module and function records of the profiler's
  Python tracer (``torch_profiler_with_stack``, vLLM's default): no marker in the serving path.
  Their sum falls short of the step by the time the worker spends outside both ranges
  (scheduling, the hand-off between steps): ``coverage`` says how much.
- ``top_ops``: the ten ops with the most self time in the steps (device kernels where the trace
  has them, else CPU ops).

Where the trace holds the model's module records but not its forward (torch-npu records modules
with ``with_modules`` and no Python calls), the backbone (its decoder layers) and the tower are
read and the rest is reported as not attributed; where a worker opens no step range
(vllm-ascend's ``NPUWorker`` steps the profiler without one), the tower's first layer, once per
step, gives the cadence. Where the steps hold no module record at all (a compiled stage 0
replays a captured graph) the components are left out, and the report says that time could not
be attributed rather than guessing.

On a CPU host every profiled step costs vLLM's worker tens of seconds after the window: it
writes the trace and, for a CPU-only profile, always builds its op table, both over every Python
call (the Triton interpreter's too). The cards profile a few dozen steps, the rehearsal two.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import time
import zlib
from pathlib import Path

from drama3_patches.tools.files import MIB, InputError, read_regular

TRACE_DIR = "profile"  # under the report folder
DELAY = 3  # steps after /start_profile left out: the request's prefill and its first decode steps
CONTROL_TIMEOUT_S = 120  # /start_profile: the workers only arm their profiler
MAX_TRACE_BYTES = 256 * MIB  # a trace file, compressed or not
MAX_TRACE_JSON = 1024 * MIB  # its JSON once decompressed
TRACE_NAMES = re.compile(r"(\.pt\.trace\.json(\.gz)?|^trace_rank\d+\.json(\.gz)?|^trace_view\.json)$")
FRAME_MS = 2048 / 44100 * 1e3  # audio per frame: a step slower than this is slower than real time
COMPONENTS = ("backbone", "tower", "sampler", "other", "outside_forward")
TOP = 10


class ProfileError(Exception):
    """Why the window could not be measured; one line."""


# -- the served deploy --------------------------------------------------------------------------


def profiler_config(trace_dir: Path, steps: int, delay: int) -> dict:
    """Stage 0's ``profiler_config`` (vLLM's ``ProfilerConfig`` fields): the torch profiler with
    Python stacks, ``delay`` steps skipped after ``/start_profile``, then ``steps + 1`` recorded
    (a step's time runs to the next one's start). The API server's own CPU trace is left out."""
    return {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": True,
            "torch_profiler_use_gzip": True, "ignore_frontend": True, "delay_iterations": delay,
            "max_iterations": steps + 1}


# -- the window ---------------------------------------------------------------------------------


def _post(url: str, body: dict, timeout: float) -> None:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read(4096)
    except urllib.error.HTTPError as exc:
        detail = exc.read(300).decode("utf-8", "replace").strip()
        hint = " (the server has no profiler endpoints: was stage 0 served with a profiler_config?)" \
            if exc.code == 404 else ""
        raise ProfileError(f"POST {url}: HTTP {exc.code} {detail}{hint}") from None
    except OSError as exc:
        raise ProfileError(f"POST {url}: {type(exc).__name__}: {exc}") from None


STOP_AFTER_SIGNAL_S = 5.0  # a server that does not answer must not hold a run a signal ended


def stop_after_signal(url: str, timeout: float = STOP_AFTER_SIGNAL_S) -> str | None:
    """``/stop_profile`` once a signal cut the window short, waiting at most ``timeout`` seconds;
    None, or why it did not answer (a note for the report, never an exception)."""
    try:
        _post(f"{url}/stop_profile", {"stages": [0]}, timeout)
    except ProfileError as exc:
        return str(exc)
    return None


def find_trace(trace_dir: Path, since: float = 0.0) -> Path | None:
    """Rank 0's newest trace file under ``trace_dir`` written after ``since`` (a bounded walk: the
    first 2000 folders, links not followed)."""
    found = []
    for walked, (root, dirs, files) in enumerate(os.walk(trace_dir)):
        if walked >= 2000:
            break
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if not TRACE_NAMES.search(name):
                continue
            path = Path(root) / name
            rank0 = re.search(r"rank0(?!\d)|tp0(?!\d)", str(path.relative_to(trace_dir)))
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            if mtime >= since and (rank0 or "rank" not in str(path.relative_to(trace_dir))):
                found.append((mtime, path))
    return max(found)[1] if found else None


def wait_for_trace(trace_dir: Path, since: float, timeout: float, poll: float = 1.0) -> tuple[Path, list]:
    """The trace and its events once it is complete: found and readable to its end (a gzip is
    written while the worker exports it, and vLLM-Omni gzips in the background)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        path = find_trace(trace_dir, since)
        if path is not None:
            try:
                return path, load_events(path)
            except (InputError, ValueError, EOFError, OSError, zlib.error) as exc:
                last = f"{path}: {exc}"
        if time.monotonic() > deadline:
            raise ProfileError(f"no complete rank-0 trace under {trace_dir} within {timeout:g} s"
                               + (f" (last seen: {last})" if last else ""))
        time.sleep(poll)


def measure(url: str, line, trace_dir: Path, *, steps: int, delay: int, timeout: float, say=None) -> dict:
    """Profile ``steps`` decode steps of one request (``line``, a ``MetaLine``) at concurrency 1;
    the ``frame_time`` figures, or ``{"error": ...}`` saying why there are none."""
    from drama3_patches.tools.bench.speech import Settings, speak_kept

    began, since = time.monotonic(), time.time() - 1
    frames = delay + steps + 4  # a few spare: the profiler stops at the step after the window
    out: dict = {"trace_dir": str(trace_dir)}
    control = min(timeout, CONTROL_TIMEOUT_S)
    try:
        _post(f"{url}/start_profile", {"stages": [0]}, control)
        # speak_kept never raises for what a server does: what escapes is a signal (validate's
        # Interrupted), which must stay what it is; validate then posts the stop itself, bounded,
        # once its report is written (stop_after_signal)
        result = speak_kept(line, Settings(url=url, timeout=timeout,
                                           extra={"max_new_tokens": frames, "seed": 3000}))
        _post(f"{url}/stop_profile", {"stages": [0]}, timeout)  # may wait for the trace's writing
        if not result.ok:
            raise ProfileError(f"the profiled request failed: {result.error}")
        if say:
            say(f"   profiled request done ({result.elapsed:.0f} s); reading the trace")
        trace, events = wait_for_trace(trace_dir, since, timeout=min(timeout, 600))
        out |= attribute(events)
        out["trace"] = str(trace)
    except (ProfileError, InputError, ValueError) as exc:
        out["error"] = str(exc)
    out["window_s"] = time.monotonic() - began
    return out


def window(url: str, line, out: Path, proc, levels: list, args, say) -> dict:
    """validate's per-frame time, after row g: :func:`measure` while the server still serves
    (its process alive, row g's requests complete), else why not."""
    if proc.poll() is not None:
        return {"error": f"skipped: the server exited (status {proc.returncode}) before the window"}
    failed = sum(lv.get("failed", 0) for lv in levels)
    if failed:
        return {"error": f"skipped: {failed} of row g's requests failed, so the server is not serving"}
    say(f"per-frame time: {args.profile_steps} decode steps of stage 0 under vLLM's profiler")
    ft = measure(url, line, out / TRACE_DIR, steps=args.profile_steps, delay=DELAY,
                 timeout=args.request_timeout, say=say)
    say(f"   {summary(ft)}")
    return ft


# -- the trace ----------------------------------------------------------------------------------

STEP = re.compile(r"^execute_(?:\d+_)?context_(\d+)\(")
FORWARD = re.compile(r"^nn\.Module: FishOmniForConditionalGeneration_\d+$|fish_omni[/\\]fish_omni_model\.py\(\d+\): "
                     r"forward$")
BACKBONE = re.compile(r"^nn\.Module: Qwen3_5Model_\d+$|models[/\\]qwen3_(?:5|next)\.py\(\d+\): forward$")
TOWER = re.compile(r"^nn\.Module: TowerLayer_\d+$|fish_omni[/\\]codebook_tower\.py\(\d+\): forward$")
HEAD = re.compile(r"^nn\.Module: Linear_\d+$")  # a codebook head, where not inside the backbone or a layer
SAMPLER = re.compile(r"fish_omni[/\\]sampling\.py\(\d+\): (?:main_tokens|code)$")
SAMPLE_TOKENS = re.compile(r"worker\.py\(\d+\): sample_tokens$")
FIRST_LAYER = re.compile(r"^nn\.Module: TowerLayer_0$")  # once per step: the steps where none is annotated
LAYER = re.compile(r"^nn\.Module: Qwen3_5DecoderLayer_\d+$")  # the backbone's, where its model has no record
_KEPT_PYTHON = (FORWARD, BACKBONE, TOWER, HEAD, SAMPLER, SAMPLE_TOKENS, LAYER)
_CHUNK = 4 * MIB


class _Ev:
    __slots__ = ("name", "cat", "ts", "end", "dur", "key", "parent")

    def __init__(self, name: str, cat: str, ts: float, dur: float, key):
        self.name, self.cat, self.ts, self.dur, self.key = name, cat, ts, dur, key
        self.end = ts + dur
        self.parent = None


def _number(value) -> float | None:
    """A time in microseconds: a number, or a numeric string (torch-npu writes ``ts`` as text to
    keep its precision)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and len(value) < 40:
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _keep(e) -> _Ev | None:
    """The record of an event the attribution reads (steps, ops, kernels, the model's modules and
    functions), or None: a Python trace holds hundreds of thousands of other calls per step."""
    if not isinstance(e, dict) or e.get("ph") != "X":
        return None
    ts, dur = _number(e.get("ts")), _number(e.get("dur"))
    if ts is None or dur is None:
        return None
    name, cat = str(e.get("name", "")), str(e.get("cat", ""))
    if name.startswith("nn.Module: ") or cat == "python_function":
        if not any(p.search(name) for p in _KEPT_PYTHON):
            return None
        cat = "python_function"
    elif isinstance(e.get("args"), dict) and "Task Type" in e["args"]:
        cat = "kernel"  # a device task in torch-npu's trace_view.json
    return _Ev(name, cat, ts, dur, (e.get("pid"), e.get("tid")))


def load_events(path: Path) -> list[_Ev]:
    """The events :func:`attribute` reads, parsed one at a time from a bounded read and a bounded,
    incremental decompression (a trace of a few steps on a CPU host is hundreds of MB of JSON)."""
    raw, _ = read_regular(str(path), MAX_TRACE_BYTES, "profiler trace")
    dec = zlib.decompressobj(16 + zlib.MAX_WBITS) if path.name.endswith(".gz") else None
    text = codecs.getincrementaldecoder("utf-8")()
    decoder = json.JSONDecoder()
    out: list[_Ev] = []
    buf, pos, fed, total, started = "", 0, 0, 0, False

    def more() -> bool:
        """Append the next piece of JSON text to ``buf``; False at the end of the input."""
        nonlocal buf, pos, fed, total
        if dec is not None and dec.unconsumed_tail:
            piece = dec.decompress(dec.unconsumed_tail, _CHUNK)
        elif fed < len(raw):
            src = raw[fed:fed + _CHUNK]
            fed += len(src)
            piece = dec.decompress(src, _CHUNK) if dec is not None else src
        else:
            return False
        total += len(piece)
        if total > MAX_TRACE_JSON:
            raise InputError(f"{path}: over {MAX_TRACE_JSON // MIB} MiB of JSON; profile fewer steps")
        buf = buf[pos:] + text.decode(piece)
        pos = 0
        return True

    while not started:
        at = buf.find('"traceEvents"')
        if at >= 0 and "[" in buf[at:]:
            pos, started = buf.index("[", at) + 1, True
        elif not more():
            raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(buf):
            if not more():
                break
            continue
        if buf[pos] == "]":
            return out
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if more():
                continue
            break
        pos = end
        ev = _keep(obj)
        if ev is not None:
            out.append(ev)
    if dec is not None and not dec.eof:
        raise EOFError(f"{path}: the gzip stream is not complete yet")
    raise ValueError(f"{path}: the trace ends inside its traceEvents list")


def _nest(events: list[_Ev]) -> None:
    """Each event's ``parent``: the innermost kept event of the same thread that contains it."""
    by_thread: dict = {}
    for ev in events:
        by_thread.setdefault(ev.key, []).append(ev)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.ts, -e.dur))
        stack: list[_Ev] = []
        for ev in evs:
            while stack and stack[-1].end < ev.end - 0.5:  # ended before it, or overlaps without containing
                stack.pop()
            ev.parent = stack[-1] if stack else None
            stack.append(ev)


def _inside(ev: _Ev, outer) -> bool:
    """Whether ``ev`` lies inside any of ``outer`` (a set of event ids)."""
    p = ev.parent
    while p is not None:
        if id(p) in outer:
            return True
        p = p.parent
    return False


def _outermost(evs: list[_Ev], match) -> list[_Ev]:
    """The matching events not inside another matching one."""
    chosen = [e for e in evs if match(e)]
    ids = {id(e) for e in chosen}
    return [e for e in chosen if not _inside(e, ids)]


def _ms(evs: list[_Ev]) -> float:
    return sum(e.dur for e in evs) / 1e3


def _percentile(values: list[float], q: float) -> float | None:
    from drama3_patches.tools.bench.stats import percentile

    return percentile(values, q)


def attribute(evs: list[_Ev]) -> dict:
    """``frame_time`` from a trace's kept events: steps, step_ms, components_ms, top_ops, coverage."""
    annotated = sorted((e for e in evs if STEP.match(e.name)), key=lambda e: e.ts)
    _nest(evs)
    if annotated:
        thread = annotated[0].key
        steps = [(cur, nxt.ts) for cur, nxt in zip(annotated, annotated[1:])
                 if cur.key == thread and STEP.match(cur.name).group(1) == "0"]  # decode steps with a successor
        marked_by = "vLLM's step annotation"
    else:  # a worker that steps the profiler without annotating (vllm-ascend's NPUWorker)
        firsts = sorted((e for e in evs if FIRST_LAYER.match(e.name)), key=lambda e: e.ts)
        steps = [(cur, nxt.ts) for cur, nxt in zip(firsts, firsts[1:]) if cur.key == nxt.key]
        marked_by = "the codebook tower's first layer (no step annotation in this trace)"
    if not steps:
        raise ProfileError("no two consecutive decode steps in the trace: no step annotation "
                           "(execute_context_0...) and no record of the codebook tower's layers")
    thread = steps[0][0].key
    periods = [(end - s.ts) / 1e3 for s, end in steps]
    mine = sorted((e for e in evs if e.key == thread), key=lambda e: e.ts)
    spans = [(step, [e for e in mine if step.ts <= e.ts and e.end <= end + 0.5]) for step, end in steps]
    forwards = [_outermost(inside, lambda e: bool(FORWARD.search(e.name))) for _, inside in spans]
    comps = {k: [] for k in COMPONENTS}
    full = bool(annotated) and all(forwards)
    for (step, period), fwd in zip(spans, forwards):
        # with the forward's record, its parts are read inside it; without, anywhere in the step
        inside = [e for e in period if _inside(e, {id(f) for f in fwd})] if full else period
        backbone = _outermost(inside, lambda e: bool(BACKBONE.search(e.name) or (not full and LAYER.match(e.name))))
        bb_ids = {id(e) for e in backbone}
        tower = _outermost([e for e in inside if not _inside(e, bb_ids)],
                           lambda e: bool(TOWER.search(e.name) or HEAD.search(e.name)))
        comps["backbone"].append(_ms(backbone))
        comps["tower"].append(_ms(tower))
        if full:
            sampler = _outermost(inside, lambda e: bool(SAMPLER.search(e.name)))
            sampled = _outermost([e for e in period if not _inside(e, {id(step)})],
                                 lambda e: bool(SAMPLE_TOKENS.search(e.name)))
            busy = step.dur / 1e3 + _ms(sampled)
            comps["sampler"].append(_ms(sampler))
            comps["other"].append(_ms(fwd) - _ms(backbone) - _ms(tower) - _ms(sampler))
            comps["outside_forward"].append(busy - _ms(fwd))
    n = len(steps)
    step_mean = sum(periods) / n
    out = {
        "steps": n,
        "step_ms": {"p50": _percentile(periods, 50), "p90": _percentile(periods, 90), "mean": step_mean},
        "frame_ms": FRAME_MS,
        "steps_from": marked_by,
    }
    mean = {k: (sum(v) / n if v else None) for k, v in comps.items()}
    if full:
        out["components_ms"] = mean
        out["component_sum_ms"] = sum(mean.values())
        out["coverage"] = out["component_sum_ms"] / step_mean if step_mean > 0 else None
        out["attributed"] = True
    elif mean["backbone"] or mean["tower"]:
        out["components_ms"] = mean
        out["unattributed_ms"] = step_mean - mean["backbone"] - mean["tower"]
        out["attributed"] = False
        out["note"] = ("partly attributed: the backbone from its decoder layers' module records and the tower from "
                       "its layers and heads; the sampler, the rest of the forward and the runner's work have no "
                       "record of their own without Python stacks" + ("" if annotated else
                                                                      ", and no step annotation bounds the step"))
    else:
        out["components_ms"] = None
        out["attributed"] = False
        out["note"] = ("cannot attribute time inside the step to backbone, tower and sampler: "
                       + ("the steps hold no record of the model's forward (a compiled stage 0 replays a captured "
                          "graph; the profiler records Python calls only with Python stacks)" if annotated else
                          "no step annotation to bound the worker's step, and no record of the model's forward"))
    out["top_ops"] = _top_ops(evs, steps, step_mean * n)
    return out


def _top_ops(evs: list[_Ev], steps, total_ms: float) -> list[dict]:
    """The ops with the most self time inside the steps: device kernels where the trace has them
    (inside the steps' span), else CPU ops on the steps' thread (self: less their CPU-op children)."""
    spans = [(s.ts, end) for s, end in steps]
    lo, hi = spans[0][0], spans[-1][1]
    kernels = [e for e in evs if e.cat.lower() == "kernel" and lo <= e.ts and e.end <= hi]
    totals: dict[str, float] = {}
    if kernels:
        for e in kernels:
            totals[e.name] = totals.get(e.name, 0.0) + e.dur
    else:
        thread = steps[0][0].key
        ops = [e for e in evs if e.cat == "cpu_op" and e.key == thread
               and any(a <= e.ts and e.end <= b + 0.5 for a, b in spans)]
        child_time: dict[int, float] = {}
        for e in ops:
            p = e.parent
            while p is not None and p.cat != "cpu_op":
                p = p.parent
            if p is not None:
                child_time[id(p)] = child_time.get(id(p), 0.0) + e.dur
        for e in ops:
            totals[e.name] = totals.get(e.name, 0.0) + max(e.dur - child_time.get(id(e), 0.0), 0.0)
    n = len(steps)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:TOP]
    return [{"name": name, "ms_per_step": us / 1e3 / n, "share": us / 1e3 / total_ms if total_ms else None}
            for name, us in ranked]


# -- the report ---------------------------------------------------------------------------------


def markdown(ft: dict | None) -> list[str]:
    """The report's "Per-frame time" section (lines)."""
    if not ft:
        return []
    head = ["", "### Per-frame time (stage 0, concurrency 1)", ""]
    if ft.get("error"):
        return head + [f"Not measured: {ft['error']}.", ""]
    s = ft["step_ms"]
    head += [f"{ft['steps']} decode steps under vLLM's torch profiler (rank 0, Python stacks on, which slows "
             f"each step): a step every {s['p50']:.1f} ms (p50), {s['p90']:.1f} ms (p90); a frame is "
             f"{FRAME_MS:.1f} ms of audio, so real time needs a step at most that long.", ""]
    comps = ft.get("components_ms")
    if comps:
        mean = s["mean"]
        head += ["| component | ms per step | share of the step |", "| --- | --- | --- |"]
        head += [f"| {k.replace('_', ' ')} | {v:.2f} | {v / mean:.0%} |" if v is not None else
                 f"| {k.replace('_', ' ')} | - | - |" for k, v in comps.items()]
        if ft["attributed"]:
            head += [f"| sum | {ft['component_sum_ms']:.2f} | {ft['coverage']:.0%} of {mean:.2f} ms |", ""]
        else:
            head += [f"| not attributed | {ft['unattributed_ms']:.2f} | {ft['unattributed_ms'] / mean:.0%} |", "",
                     f"Components: {ft['note']}.", ""]
    else:
        head += [f"Components: {ft.get('note', 'cannot attribute time inside the step')}.", ""]
    if ft.get("top_ops"):
        head += ["| top op by self time | ms per step | share |", "| --- | --- | --- |"]
        head += [f"| `{o['name'][:80].replace('|', '/')}` | {o['ms_per_step']:.2f} | "
                 f"{(o['share'] or 0):.0%} |" for o in ft["top_ops"]]
        head.append("")
    head += [f"Trace: `{ft.get('trace', ft.get('trace_dir'))}`; the window took {ft.get('window_s', 0):.0f} s.", ""]
    return head


def summary(ft: dict | None) -> str:
    """The per-frame time in one line (validate's progress)."""
    if not ft:
        return "not profiled"
    if ft.get("error"):
        return f"not measured: {ft['error']}"
    line = f"{ft['steps']} steps, a step every {ft['step_ms']['p50']:.1f} ms (p50)"
    comps = ft.get("components_ms")
    if not comps:
        return line + "; components not attributed"
    known = ", ".join(f"{k.replace('_', ' ')} {v:.1f} ms" for k, v in comps.items() if v is not None)
    if not ft["attributed"]:
        return line + f"; {known}, {ft['unattributed_ms']:.1f} ms not attributed"
    return line + f"; {known} ({ft['coverage']:.0%} of the step)"
