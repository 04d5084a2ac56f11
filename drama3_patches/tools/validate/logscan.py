"""The server's log, read once, as it grows: each line goes past every reader that needs it.

:class:`LogScan` reads ``server.log`` from where it stopped last time, in bounded chunks (a line
longer than ``MAX_LINE`` bytes is cut there), and keeps only what the rows and the diagnosis
use: the processes' roles, stage 0's graph-capture and compile lines (apart), the lines no healthy run prints, the
known failure signatures with the line that showed each, and the last lines. Its memory does
not grow with the log.
"""

from __future__ import annotations

import os
import re
import stat
from collections import Counter, deque

from drama3_patches.tools.validate import diagnose

CHUNK = 1024 * 1024
# The level validate serves at, whatever the operator's shell says: the rows read INFO records
# (graph capture, each process's loading) and row f needs records from every stage-0 process.
SERVER_LOG_LEVEL = "INFO"
SERVER_ENV = {"VLLM_LOGGING_LEVEL": SERVER_LOG_LEVEL}  # set in the served environment
MAX_LINE = 16 * 1024
TAIL_LINES = 200
SHOWN_BAD = 12
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PREFIX = re.compile(r"\((APIServer|StageEngineCoreProc_stage(\d+)_replica\d+|Worker(?:_TP(\d+))?) pid=(\d+)\)")
# The record's level right after the prefix, as vLLM's formatter writes it ("(X pid=N) INFO 12-04 ...").
_LEVEL = re.compile(r"^\s*(?:\([\w.-]+ pid=\d+\)\s*)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
# A graph captured (not only compiled). vLLM 0.32's runners end their capture with "Graph capturing
# finished in %.0f secs, took %.2f GiB" (v1/worker/gpu_model_runner.py, v1/worker/gpu/model_runner.py);
# vLLM-Ascend 0.30.0rc2 (its sdist) inherits that record (worker/model_runner_v1.py's capture_model
# calls vLLM's; worker/v2's NPUModelRunner subclasses vLLM's) and adds its own: "Capturing ACL graph
# (%s, %s)" (DEBUG, compilation/acl_graph.py), "ACL graph replay is active (logged once)."
# (compilation/acl_graph.py) and "ACL graph replay is active for the V2 target model"
# (worker/v2/aclgraph_utils.py).
CAPTURE = re.compile(r"Graph capturing finished in |Capturing ACL graph \(|ACL graph replay is active")
# Compiled by Dynamo/Inductor (vLLM 0.32's compilation/backends.py, torch's symbolic_convert.py):
# no graph is captured by these.
COMPILE = re.compile(r"Compiling a graph for compile range|Directly load the compiled graph|"
                     r"Dynamo bytecode transform time|torchdynamo done tracing")
# A line saying capture is off never counts, whatever else it says (vLLM-Ascend's "Compilation
# disabled, using eager mode by default", "cudagraph_mode %s is unsupported on NPU; falling back to NONE").
NO_CAPTURE = re.compile(r"disabled|disabling|falling back to NONE|unsupported|not supported", re.IGNORECASE)

# A line of the server's log that no healthy run prints: (what, pattern). The first two count
# wherever they appear; the others only outside INFO / WARNING / DEBUG records, whose advice
# ("... will cause a CUDA array out-of-bounds error") names failures that did not happen.
ANYWHERE = (
    ("traceback", re.compile(r"Traceback \(most recent call last\)")),
    ("runtime check", re.compile(r"TensorParallelDrift|ResumedHistoryMismatch")),
)
BAD_LINES = (
    ("device error", re.compile(r"\b(ACL|aclnn|AclNN|CANN|NPU|CUDA|HBM)\b.*\b(error|failed|fault)\b|"
                                r"\bE[ZEHLKRJ]\d{4}\b|device-side assert|RuntimeError: .*(npu|NPU|device)")),
    ("collective error", re.compile(r"\b(HCCL|NCCL|hccl|nccl|gloo|Gloo)\b.*\b(error|timeout|timed out|failed)\b|"
                                    r"Connection reset by peer|DistBackendError|DistNetworkError")),
    ("out of memory", re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)),
    ("engine died", re.compile(r"EngineDeadError|Engine core.*(died|failed)|worker.*died unexpectedly",
                               re.IGNORECASE)),
)
_ADVICE = {"INFO", "WARNING", "DEBUG"}


class Roles:
    """pid -> role from the log's ``(ROLE pid=N)`` prefixes: ``api-server``, ``engine-core stage N``,
    ``worker stage N rank R``. A worker's stage is told by what it loads (stage 0 the DAC encoder
    for voice references, stage 1 the DAC decoder); its rank by its ``_TP`` suffix, which only a
    stage of several ranks has: where one rank logs nothing of its loading, that suffix places it
    in the stage given to :meth:`resolved`."""

    def __init__(self) -> None:
        self.named: dict[int, str] = {}  # api-server and engine cores: named by their prefix
        self.stages: dict[int, int | None] = {}  # worker pid -> its stage, once its loading told it
        self.ranks: dict[int, int] = {}  # worker pid -> the rank its _TP suffix says (a later line may add it)

    def feed(self, line: str, match: re.Match | None) -> None:
        if match is None:
            return
        name, stage, rank, pid = match.group(1), match.group(2), match.group(3), int(match.group(4))
        if name == "APIServer":
            self.named.setdefault(pid, "api-server")
            return
        if stage is not None:
            self.named.setdefault(pid, f"engine-core stage {stage}")
            return
        self.stages.setdefault(pid, None)
        if rank is not None:
            self.ranks[pid] = int(rank)
        if "Loaded DAC codec encoder" in line:
            self.stages[pid] = 0
        elif "DAC codec loaded" in line and self.stages[pid] != 0:
            self.stages[pid] = 1

    def resolved(self, multi_rank_stage: int | None = None) -> dict[int, str]:
        roles = dict(self.named)
        for pid, stage in self.stages.items():
            if stage is None and pid in self.ranks and multi_rank_stage is not None:
                stage = multi_rank_stage
            roles[pid] = "worker stage ?" if stage is None else f"worker stage {stage} rank {self.ranks.get(pid, 0)}"
        return roles


def process_roles(text: str, multi_rank_stage: int | None = None) -> dict[int, str]:
    """:class:`Roles` of a whole text (tests, short logs)."""
    roles = Roles()
    for line in text.splitlines():
        roles.feed(line, _PREFIX.search(line))
    return roles.resolved(multi_rank_stage)


def is_stage0(role: str) -> bool:
    return role == "engine-core stage 0" or role.startswith("worker stage 0")


class LogScan:
    """What the rows read from ``server.log``, gathered as the log grows (:meth:`poll`)."""

    def __init__(self, path) -> None:
        self.path = path
        self.offset = 0
        self._partial = b""
        self.roles = Roles()
        self.captures: Counter = Counter()  # pid -> graph-capture records (INFO/DEBUG or unlevelled)
        self.compiles: Counter = Counter()  # pid -> Dynamo/Inductor compile records
        self.records: Counter = Counter()  # pid -> log records (a level after the prefix): row f
        self.bad_count = 0
        self.bad_shown: list[str] = []
        self.drift = False
        self.found = diagnose.Matcher()
        self.tail: deque = deque(maxlen=TAIL_LINES)

    def poll(self, until: int | None = None) -> None:
        """Read what the log gained since the last call (up to byte ``until``), line by line."""
        try:  # the log validate made: a link or a FIFO put in its place is not read (nor waited on)
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return
        with os.fdopen(fd, "rb") as fh:
            fh.seek(self.offset)
            while until is None or self.offset < until:
                want = CHUNK if until is None else min(CHUNK, until - self.offset)
                raw = fh.read(want)
                if not raw:
                    break
                self.offset += len(raw)
                self._split(raw)

    def feed_text(self, text: str) -> None:
        """Lines given as text (a log excerpt), as if the log had grown by them."""
        self._split(text.encode("utf-8"))

    def finish(self) -> None:
        """The last line, if the log does not end with a newline."""
        if self._partial:
            self._line(self._partial)
            self._partial = b""

    def _split(self, raw: bytes) -> None:
        data = self._partial + raw
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            self._line(data[start:end])
            start = end + 1
        rest = data[start:]
        # an endless line is cut into MAX_LINE pieces: memory stays bounded
        while len(rest) > MAX_LINE:
            self._line(rest[:MAX_LINE])
            rest = rest[MAX_LINE:]
        self._partial = rest

    def _line(self, raw: bytes) -> None:
        line = _ANSI.sub("", raw[:MAX_LINE].decode("utf-8", "replace")).rstrip("\r")
        self.tail.append(line)
        match = _PREFIX.search(line)
        self.roles.feed(line, match)
        level = _LEVEL.match(line)
        level = level.group(1) if level else None
        if match is not None and level is not None:
            self.records[int(match.group(4))] += 1
        if match is not None and level in (None, "INFO", "DEBUG") and not NO_CAPTURE.search(line):
            if CAPTURE.search(line):
                self.captures[int(match.group(4))] += 1
            elif COMPILE.search(line):
                self.compiles[int(match.group(4))] += 1
        if "TensorParallelDrift" in line:
            self.drift = True
        self.found.feed(line, self.tail)
        for what, pattern in ANYWHERE + (() if level in _ADVICE else BAD_LINES):
            if pattern.search(line):
                self.bad_count += 1
                if len(self.bad_shown) < SHOWN_BAD:
                    self.bad_shown.append(f"{what}: {line.strip()[:300]}")
                break

    @property
    def lines(self) -> int:
        """Lines read so far (the matcher sees every one and numbers them)."""
        return self.found.lines

    def role_map(self, multi_rank_stage: int | None = None) -> dict[int, str]:
        return self.roles.resolved(multi_rank_stage)

    def stage0_captures(self, roles: dict[int, str]) -> int:
        """Graph-capture records printed by stage 0's engine core or workers."""
        return sum(n for pid, n in self.captures.items() if is_stage0(roles.get(pid, "")))

    def stage0_graphs(self, roles: dict[int, str]) -> dict:
        """Row a's evidence: capture records per stage-0 worker (every one the log names, none
        left out for having none), and stage 0's compile records."""
        workers = {role: 0 for role in roles.values() if role.startswith("worker stage 0")}
        for pid, n in self.captures.items():
            if roles.get(pid, "") in workers:
                workers[roles[pid]] += n
        compiled = sum(n for pid, n in self.compiles.items() if is_stage0(roles.get(pid, "")))
        return {"captures": dict(sorted(workers.items())), "compiles": compiled}
