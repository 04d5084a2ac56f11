"""Where a frame's time goes: stage 0 profiled by vLLM's own profiler for a window of decode steps.

The served deploy gives stage 0 a ``profiler_config`` (:func:`profiler_config`): vLLM's torch
profiler, writing into the report folder, off until asked. vLLM-Omni then serves
``/start_profile`` and ``/stop_profile`` (``entrypoints/serve/profile/utils.py``). After the
other phases, :func:`measure` starts it on stage 0, sends one request at concurrency 1, and
stops it; the profiler itself skips the first ``delay`` steps (the prefill, the first decode)
and records the next ones (``delay_iterations``, ``max_iterations``), so the window holds decode
steps only. Nothing else runs meanwhile, and no other phase runs under it.

The trace is a Chrome trace (``*.pt.trace.json.gz`` from vLLM's worker, ``trace_rank0.json.gz``
from vLLM-Omni's, ``trace_view.json`` from torch-npu's). :func:`read` gives the per-frame table
of any such file (validate's window and the ``frame-time`` command alike):

- a step is vLLM's per-step annotation (``execute_context_0(0)_generation_1(1)``, a
  ``record_function`` range the worker opens while a profiler runs); ``step_ms`` is the time
  from one decode step's start to the next's, the cadence at which stage 0 makes frames; where a
  worker opens no step range (vllm-ascend's ``NPUWorker``), the tower's first layer, once per
  step, gives the cadence;
- each component is the time its own records cover, counted once (innermost first), never a
  remainder: ``backbone``, ``tower`` and ``sampler`` (found by their place in the model's
  forward, class and file names only as the fallback; ``rules`` says which matched),
  ``rest_of_forward`` (the other records inside the forward), ``outside_forward`` (the step's
  annotated range and the worker's ``sample_tokens`` outside the forward); ``unattributed_ms`` is
  the step time no record covers (the forward's own Python, the hand-off between steps);
- ``problems``: a component that must run at stage 0 (backbone, tower, sampler) with no record
  in some step, a missing forward record, a sampler call nested inside another component;
- ``top_ops``: the ten ops with the most self time in the steps (device kernels where the trace
  has them, else CPU ops).

The records are the module and function records of the profiler's Python tracer
(``torch_profiler_with_stack``, vLLM's default; torch-npu's ``with_modules`` gives module records
only): no marker in the serving path. The structural rules read the model's published forward
(vLLM-Omni's ``fish_omni_model.py``): it calls the backbone (``self.model``, a Qwen3.5 model
holding a stack of decoder layers) first, then the sampler's ``main_tokens``, then its own
tower layers and codebook heads (modules it calls itself), with the sampler's ``code`` between
them. So a subclass under another class or file name (vLLM-Ascend replaces classes) is still
found. Where the steps hold no model record at all (a compiled stage 0 replays a captured graph)
every component is a problem and the time is unattributed, never guessed.

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
COMPONENTS = ("backbone", "tower", "sampler", "rest_of_forward", "outside_forward")
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
        out |= read(trace, events=events)
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
# The structural rules read the module tree: a module record is ``nn.Module: Class_N``, a Python
# call ``file.py(N): function``. Class and file names below are the fallback only.
FUNCTION = re.compile(r"\(\d+\): (?:forward|main_tokens|code|sample_tokens)$")  # the calls the rules read
# FusedFrameSampler's two methods, whatever its file (not torch's own ``code``, fx's property)
SAMPLER_CALL = re.compile(r"^(?!.*(?:^|[/\\])torch[/\\]).*\(\d+\): (?:main_tokens|code)$")
BACKBONE = re.compile(r"^nn\.Module: Qwen3_5Model_\d+$|models[/\\]qwen3_(?:5|next)\.py\(\d+\): forward$")
LAYER = re.compile(r"^nn\.Module: Qwen3_5DecoderLayer_\d+$")  # the backbone's, where its model has no record
TOWER = re.compile(r"^nn\.Module: TowerLayer_\d+$|fish_omni[/\\]codebook_tower\.py\(\d+\): forward$")
HEAD = re.compile(r"^nn\.Module: Linear_\d+$")  # a codebook head, where not inside the backbone or a layer
SAMPLER = re.compile(r"fish_omni[/\\]sampling\.py\(\d+\): (?:main_tokens|code)$")
SAMPLE_TOKENS = re.compile(r"worker\.py\(\d+\): sample_tokens$")
FIRST_LAYER = re.compile(r"^nn\.Module: TowerLayer_0$")  # once per step: the steps where none is annotated
MUST_RUN = ("backbone", "tower", "sampler")  # at stage 0, in every decode step
_KEPT_PYTHON = (FORWARD, FUNCTION, BACKBONE, TOWER, SAMPLER, SAMPLE_TOKENS)
_CHUNK = 4 * MIB
# A record longer than this that still does not parse is malformed, not cut by a chunk's end.
MAX_RECORD = 1 * MIB
# Where a record may end: its closing brace before the next record or the list's end.
_RECORD_END = re.compile(r"\}(?=\s*(?:,\s*\{|\]))")
# A one-line string member, as torch's exporter writes them (``"name": "...",``).
_STRING_LINE = re.compile(r'^(\s*"[^"\n]*":\s*")(.*)("\s*,?[ \t]*)$', re.M)
_TRIES = 8  # record ends tried per malformed record


class Events(list):
    """The kept records of a trace, and how many records were mended or left out: torch's Chrome
    trace exporter writes a name as it is, so a Python function whose name holds a quote (seen:
    ``_cupti_monitor.py(0): "pending"``, torch 2.13 on CPU) makes the file invalid JSON."""

    repaired = 0
    dropped = 0


def _mend(text: str):
    """The record ``text`` parsed once each one-line string member's stray quotes and backslashes
    are escaped, or None."""
    def escape(m):
        value = m.group(2)
        try:
            json.loads(f'"{value}"')
            return m.group(0)
        except json.JSONDecodeError:
            return m.group(1) + json.dumps(value)[1:-1] + m.group(3)
    try:
        return json.loads(_STRING_LINE.sub(escape, text))
    except json.JSONDecodeError:
        return None


class _Ev:
    __slots__ = ("name", "cat", "ts", "end", "dur", "key", "parent", "kids")

    def __init__(self, name: str, cat: str, ts: float, dur: float, key):
        self.name, self.cat, self.ts, self.dur, self.key = name, cat, ts, dur, key
        self.end = ts + dur
        self.parent = None
        self.kids: list = []  # the kept Python records directly inside it (modules and calls)

    @property
    def module(self) -> bool:
        return self.name.startswith("nn.Module: ")


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
        if not name.startswith("nn.Module: ") and not any(p.search(name) for p in _KEPT_PYTHON):
            return None
        cat = "python_function"
    elif isinstance(e.get("args"), dict) and "Task Type" in e["args"]:
        cat = "kernel"  # a device task in torch-npu's trace_view.json
    return _Ev(name, cat, ts, dur, (e.get("pid"), e.get("tid")))


def load_events(path: Path) -> Events:
    """The events :func:`attribute` reads, parsed one at a time from a bounded read and a bounded,
    incremental decompression (a trace of a few steps on a CPU host is hundreds of MB of JSON).
    A record that does not parse although the text goes on past it is mended where a string
    member's quotes are the fault (counted in ``repaired``), else left out (``dropped``)."""
    raw, _ = read_regular(str(path), MAX_TRACE_BYTES, "profiler trace")
    dec = zlib.decompressobj(16 + zlib.MAX_WBITS) if path.name.endswith(".gz") else None
    text = codecs.getincrementaldecoder("utf-8")()
    decoder = json.JSONDecoder()
    out = Events()
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
            if len(buf) - pos <= MAX_RECORD and more():
                continue  # most likely a record cut by the chunk's end: read on
            ends = [m.end() for _, m in zip(range(_TRIES), _RECORD_END.finditer(buf, pos, pos + MAX_RECORD))]
            if not ends:
                break  # the text ends inside a record: an unfinished file
            mended = next(((o, e) for o, e in ((_mend(buf[pos:e]), e) for e in ends) if o is not None), None)
            if mended is None:
                out.dropped += 1
                pos = ends[0]
                continue
            out.repaired += 1
            obj, end = mended
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
            ev.kids = []
            owner = ev.parent  # a Python call's caller: the nearest Python record (past a custom op's)
            while owner is not None and owner.cat != "python_function":
                owner = owner.parent
            if owner is not None and ev.cat == "python_function":
                owner.kids.append(ev)
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


# -- intervals: each component is the time its records cover, painted once ----------------------


def _union(spans) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _minus(spans: list, cut: list) -> list[tuple[float, float]]:
    """``spans`` less ``cut`` (both merged and sorted)."""
    out, j = [], 0
    for a, b in spans:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > a:
                out.append((a, cut[k][0]))
            a = max(a, cut[k][1])
            k += 1
        if a < b:
            out.append((a, b))
    return out


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _spans(evs, lo: float, hi: float) -> list[tuple[float, float]]:
    return _union((max(e.ts, lo), min(e.end, hi)) for e in evs)


# -- the structural rules -----------------------------------------------------------------------


def _stem(ev: _Ev) -> str:
    """A module record's class (``nn.Module: Qwen3_5DecoderLayer_3`` -> ``Qwen3_5DecoderLayer``)."""
    return re.sub(r"_\d+$", "", ev.name[len("nn.Module: "):]) if ev.module else ev.name


def _calls(ev: _Ev) -> list[_Ev]:
    """The module and function records ``ev`` makes itself, its own ``forward`` call looked through
    (a module record holds its forward's)."""
    kids = ev.kids
    while len(kids) == 1 and not kids[0].module and kids[0].name.endswith(": forward"):
        kids = kids[0].kids
    return kids


def _modules_under(ev: _Ev) -> list[_Ev]:
    """The nearest module records inside ``ev`` (through function records)."""
    out, todo = [], list(ev.kids)
    while todo:
        k = todo.pop()
        if k.module:
            out.append(k)
        else:
            todo.extend(k.kids)
    return out


def _stack(ev: _Ev) -> tuple[str, int] | None:
    """The decoder layers ``ev`` holds: two or more module records of one class directly inside
    it, each a container of modules (a leaf like a norm is no layer)."""
    counts: dict[str, int] = {}
    for m in _modules_under(ev):
        if _modules_under(m):
            counts[_stem(m)] = counts.get(_stem(m), 0) + 1
    if not counts:
        return None
    stem, n = max(counts.items(), key=lambda kv: kv[1])
    return (stem, n) if n >= 2 else None


def _find_backbone(calls: list[_Ev], stop: float, last: bool = False) -> tuple[list[_Ev], str | None]:
    """The backbone among the forward's calls before ``stop`` (its first sampler call): the first
    call holding a stack of layers, else a run of two or more layers called directly (the last run
    where the period starts at the tower, so that the next step's backbone closes it)."""
    early = [c for c in calls if c.ts < stop]
    for c in early:
        st = _stack(c)
        if st:
            return [c], f"structure: the forward's first call holding decoder layers ({st[1]} x {st[0]})"
    runs: list[list[_Ev]] = []
    for c in early:
        layer = c.module and bool(_modules_under(c))
        if layer and runs and runs[-1] and _stem(runs[-1][0]) == _stem(c):
            runs[-1].append(c)
        else:
            runs.append([c] if layer else [])
    runs = [r for r in runs if len(r) >= 2]
    if runs:
        run = runs[-1] if last else runs[0]
        which = "last" if last else "first"
        return run, f"structure: the {which} stack of layers called ({len(run)} x {_stem(run[0])})"
    return [], None


def _by_name(inside: list[_Ev], pattern) -> list[_Ev]:
    return _outermost(inside, lambda e: bool(pattern.search(e.name)))


def _parts(step: _Ev, end: float, period: list[_Ev], bounded: bool) -> dict:
    """One step's records of each component and the rule that found them."""
    fwd = _outermost(period, lambda e: e.cat == "python_function" and bool(FORWARD.search(e.name)))
    f_ids = {id(f) for f in fwd}
    inside = [e for e in period if _inside(e, f_ids)] if fwd else period
    if fwd:
        calls = sorted((c for f in fwd for c in _calls(f)), key=lambda e: e.ts)
    else:  # no forward record: the step's outermost Python records stand for its calls
        py = [e for e in period if e.cat == "python_function"]
        ids = {id(e) for e in py}
        calls = [e for e in py if not _inside(e, ids)]
    found, rules = {}, {}
    # the sampler: FusedFrameSampler's methods called by the forward; by file name elsewhere
    sampler = _by_name(inside, SAMPLER_CALL)
    rules["sampler"] = "structure: the sampler's main_tokens and code calls in the forward" if sampler else None
    if not sampler:
        sampler = _by_name(inside, SAMPLER)
        rules["sampler"] = "class name: fish_omni/sampling.py" if sampler else None
    # the backbone runs before the sampler's first draw, unless the period starts at the tower
    first_draw = min((s.ts for s in sampler), default=end) if bounded else end
    backbone, rules["backbone"] = _find_backbone(calls, first_draw, last=not bounded)
    if not backbone:
        backbone = _by_name(inside, BACKBONE) or _by_name(inside, LAYER)
        rules["backbone"] = f"class name: {_stem(backbone[0])}" if backbone else None
    b_ids = {id(e) for e in backbone}
    if bounded:  # the module calls the forward makes after the backbone returns
        b_end = max((b.end for b in backbone), default=None)
        tower = [c for c in calls if c.module and b_end is not None and c.ts >= b_end - 0.5 and id(c) not in b_ids]
        where = "after the backbone"
    else:  # the period starts at the tower's first layer: the module calls up to the next backbone
        b_start = min((b.ts for b in backbone), default=end)
        tower = [c for c in calls if c.module and c.end <= b_start + 0.5 and id(c) not in b_ids]
        where = "from the tower's first layer to the backbone"
    rules["tower"] = (f"structure: the module calls {where} ({len(tower)}: "
                      f"{', '.join(sorted({_stem(t) for t in tower}))})") if tower else None
    if not tower:
        tower = _outermost([e for e in inside if not _inside(e, b_ids) and id(e) not in b_ids],
                           lambda e: bool(TOWER.search(e.name) or HEAD.search(e.name)))
        rules["tower"] = f"class name: {', '.join(sorted({_stem(t) for t in tower}))}" if tower else None
    found = {"backbone": backbone, "tower": tower, "sampler": sampler}
    t_ids = {id(e) for e in tower}
    nested = {comp: sum(1 for s in sampler if _inside(s, ids))
              for comp, ids in (("backbone", b_ids), ("tower", t_ids))}
    # painted once, innermost first: a sampler call inside a tower layer is the sampler's time
    lo, hi = step.ts, end
    s_iv = _spans(sampler, lo, hi)
    t_iv = _minus(_spans(tower, lo, hi), s_iv)
    b_iv = _minus(_minus(_spans(backbone, lo, hi), t_iv), s_iv)
    named = _union(s_iv + t_iv + b_iv)
    out = {k: _length(v) / 1e3 for k, v in (("backbone", b_iv), ("tower", t_iv), ("sampler", s_iv))}
    covered = named
    if fwd:
        f_iv = _spans(fwd, lo, hi)
        rest = _minus(_spans(inside, lo, hi), named)
        outside = _minus(_spans([e for e in period if id(e) not in f_ids and not _inside(e, f_ids)], lo, hi), f_iv)
        out["rest_of_forward"], out["outside_forward"] = _length(rest) / 1e3, _length(outside) / 1e3
        covered = _union(named + rest + outside)
    else:
        out["rest_of_forward"] = out["outside_forward"] = None
    out["unattributed"] = (hi - lo - _length(covered)) / 1e3
    return {"ms": out, "found": {k: bool(v) for k, v in found.items()}, "rules": rules, "nested": nested,
            "forward": bool(fwd)}


def rank_of(path) -> str:
    """The rank a trace's file or folder names (vLLM's ``..._rank0.N.pt.trace.json.gz``, vLLM-Omni's
    ``trace_rank0``, torch-npu's ``stage0_rank0/``), else ``unknown``."""
    found = re.findall(r"rank(\d+)", str(path))
    return found[-1] if found else "unknown"


def attribute(evs: list[_Ev], *, limit: int | None = None) -> dict:
    """``frame_time`` from a trace's kept events: steps, step_ms, components_ms, unattributed_ms,
    rules, problems, top_ops; the step and the component figures from the same steps (the first
    ``limit`` decode steps with a successor, all of them by default)."""
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
    if limit is not None:
        steps = steps[:limit]
    thread = steps[0][0].key
    periods = [(end - s.ts) / 1e3 for s, end in steps]
    mine = sorted((e for e in evs if e.key == thread), key=lambda e: e.ts)
    parts = []
    for step, end in steps:
        period = [e for e in mine if step.ts <= e.ts and e.end <= end + 0.5]
        parts.append(_parts(step, end, period, bounded=bool(annotated)))
    n = len(steps)
    step_mean = sum(periods) / n
    mean = {k: (sum(p["ms"][k] for p in parts) / n if all(p["ms"][k] is not None for p in parts) else None)
            for k in COMPONENTS + ("unattributed",)}
    unattributed = mean.pop("unattributed")
    share = unattributed / step_mean if step_mean > 0 else 0.0
    problems = []
    if not all(p["forward"] for p in parts):
        missing = sum(not p["forward"] for p in parts)
        problems.append(f"forward: no record of the model's forward in {missing} of {n} steps, so the rest of the "
                        "forward and the time outside it are not measured" if annotated else
                        "forward: no step annotation, so the steps run from one tower first layer to the next and "
                        "cut the forward's record: the rest of the forward and the time outside it are not measured")
    for comp in MUST_RUN:
        missing = sum(not p["found"][comp] for p in parts)
        if missing:
            problems.append(f"{comp}: no record matched in {missing} of {n} steps; {share:.0%} of the step is "
                            "unattributed")
    for comp in ("backbone", "tower"):
        hit = [p["nested"][comp] for p in parts if p["nested"][comp]]
        if hit:
            problems.append(f"sampler: {sum(hit)} of its records lie inside the {comp}'s in {len(hit)} of {n} steps: "
                            f"counted once, as the sampler's, and taken out of the {comp}")
    rules = {}
    for comp in MUST_RUN:
        seen = sorted({p["rules"][comp] for p in parts if p["rules"][comp]})
        rules[comp] = "; ".join(seen) if seen else None
    return {
        "steps": n,
        "step_ms": {"p50": _percentile(periods, 50), "p90": _percentile(periods, 90), "mean": step_mean},
        "frame_ms": FRAME_MS,
        "steps_from": marked_by,
        "components_ms": mean,
        "unattributed_ms": unattributed,
        "rules": rules,
        "problems": problems,
        "top_ops": _top_ops(evs, steps, step_mean * n),
    }


def read(path: Path, *, limit: int | None = None, events: list | None = None) -> dict:
    """The per-frame table of one saved trace (``frame-time`` and validate's window alike)."""
    events = load_events(path) if events is None else events
    out = attribute(events, limit=limit)
    repaired, dropped = getattr(events, "repaired", 0), getattr(events, "dropped", 0)
    if dropped:  # a left-out record may have been any component's: the figures cannot be vouched for
        out["problems"] = [*out["problems"], f"{dropped} record(s) of the trace did not parse and were left out"]
    return out | {"rank": rank_of(path), "trace": str(path), "records_repaired": repaired, "records_dropped": dropped}


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


def table(ft: dict) -> list[str]:
    """The per-frame table of one trace (lines): validate's section and ``frame-time``'s output."""
    s = ft["step_ms"]
    mean = s["mean"]
    out = [f"{ft['steps']} decode steps of rank {ft.get('rank', 'unknown')} (steps from {ft['steps_from']}): a step "
           f"every {s['p50']:.1f} ms (p50), {s['p90']:.1f} ms (p90); a frame is {FRAME_MS:.1f} ms of audio, so "
           "real time needs a step at most that long. Each component is the time its own records cover, counted "
           "once; what no record covers is unattributed.", "",
           "| component | ms per step | share of the step | found by |", "| --- | --- | --- | --- |"]
    rules = ft.get("rules") or {}
    for k, v in ft["components_ms"].items():
        how = rules.get(k) or ("-" if k in MUST_RUN else "its records")
        out.append(f"| {k.replace('_', ' ')} | {v:.2f} | {v / mean:.0%} | {how} |" if v is not None else
                   f"| {k.replace('_', ' ')} | - | - | not measured |")
    u = ft["unattributed_ms"]
    out += [f"| unattributed | {u:.2f} | {u / mean:.0%} | no record |", ""]
    if ft["problems"]:
        out += ["Problems:", ""] + [f"- {p}" for p in ft["problems"]] + [""]
    if ft.get("top_ops"):
        out += ["| top op by self time | ms per step | share |", "| --- | --- | --- |"]
        out += [f"| `{o['name'][:80].replace('|', '/')}` | {o['ms_per_step']:.2f} | "
                f"{(o['share'] or 0):.0%} |" for o in ft["top_ops"]]
        out.append("")
    return out


def markdown(ft: dict | None) -> list[str]:
    """The report's "Per-frame time" section (lines)."""
    if not ft:
        return []
    head = ["", "### Per-frame time (stage 0, concurrency 1)", ""]
    if ft.get("error"):
        return head + [f"Not measured: {ft['error']}.", ""]
    head += ["Under vLLM's torch profiler (Python stacks on, which slows each step).", ""]
    head += table(ft)
    head += [f"Trace: `{ft.get('trace', ft.get('trace_dir'))}`; the window took {ft.get('window_s', 0):.0f} s.", ""]
    return head


def summary(ft: dict | None) -> str:
    """The per-frame time in one line (validate's progress)."""
    if not ft:
        return "not profiled"
    if ft.get("error"):
        return f"not measured: {ft['error']}"
    line = f"{ft['steps']} steps of rank {ft.get('rank', 'unknown')}, a step every {ft['step_ms']['p50']:.1f} ms (p50)"
    known = ", ".join(f"{k.replace('_', ' ')} {v:.1f} ms" for k, v in ft["components_ms"].items() if v is not None)
    line += f"; {known}, {ft['unattributed_ms']:.1f} ms unattributed" if known else \
        f"; {ft['unattributed_ms']:.1f} ms unattributed"
    if ft["problems"]:
        line += f"; {len(ft['problems'])} problem(s): " + "; ".join(ft["problems"])
    return line
