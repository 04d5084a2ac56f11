"""The patches on vLLM's ``/metrics``: a Prometheus collector over the per-process reports.

Registered once, in the process that serves the HTTP app (patch ``metrics-endpoint``), into
prometheus_client's default ``REGISTRY``, which vLLM's ``/metrics`` reads when one API server
runs. At each scrape it reads ``$DRAMA3_PATCHES_REPORT_DIR`` through the bounded, owner-checked
reader (``drama3_patches.report_dir``, unchanged files from its cache) and this process's own
state from the engine, and exports:

- ``drama3_patches_patch_state{patch,state,role,stage,rank,host}``: 1 for the state each process
  is in, 0 for the others (processes of the same labels add up);
- ``drama3_patches_events_total{event,role,stage,rank,host}``: the runtime counters;
- ``drama3_patches_process_info{role,stage,rank,host,pid,platform,enabled}``: 1 per process;
- ``drama3_patches_reports{status}``: reports ``live`` (exported), ``gone`` (their process ended,
  or its pid went to another process), ``remote`` (another host's: not exported),
  ``skipped`` (unusable files, and reports left unread by the scrape's bound, by kind in
  ``drama3_patches_reports_skipped{reason}``), and ``folder-unset``: 1 when no report folder is
  set (only this process is exported);
- ``drama3_patches_collector_errors_total``: scrapes whose collection failed (then only this
  series is ours on the page; vLLM's stay whole).

A scrape is bounded (``report_dir``): foreign files are refused from their ``lstat``, unopened;
at most ``MAX_LISTED`` entries are looked at and ``SCRAPE_MAX_BYTES`` of new reports read, the
newest first (prometheus_client runs ``collect`` on the API server's event loop).

Every label value is from a fixed set (manifest ids, states, event names, roles, skip kinds,
numbers, a host name of ``[A-Za-z0-9._]``), never text from a report. Imported only by that
patch's wrapper, when vLLM builds its app: prometheus_client is vLLM's import there, not ours.
"""

from __future__ import annotations

import os
import threading

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from drama3_patches import env
from drama3_patches.logger import init_logger

logger = init_logger(__name__)

REPORT_STATUSES = ("live", "gone", "remote", "skipped", "folder-unset")
OTHER = "other"  # an id, state, role or platform outside the known set
MAX_STAGE = 1000
MAX_RANK = 1 << 20


def _number(value, limit: int) -> str:
    """A stage or rank label: the number, or "" where none is known (or it is not a small whole number)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit:
        return str(value)
    return ""


class PatchCollector:
    """The collector (``collect``/``describe``, as prometheus_client calls them). Never raises:
    a failed collection is counted and logged once, and the scrape goes on without our series."""

    def __init__(self) -> None:
        from drama3_patches.report_dir import Cache

        self._cache = Cache()
        self._lock = threading.Lock()  # scrapes may overlap; the cache is not shared between them
        self.errors = 0
        self._logged = False

    # -- prometheus_client's protocol ----------------------------------------------------------

    def describe(self):
        """The families without samples: registering reads nothing."""
        return [*(family for family, _ in self._families()), self._errors()]

    def collect(self):
        try:
            with self._lock:
                families = self._collect()
        except Exception as exc:  # never a 500 for the whole page
            self.errors += 1
            if not self._logged:
                self._logged = True
                logger.warning("drama3-patches: the /metrics collector failed (%s: %s); its series are left "
                               "out of this scrape and counted in drama3_patches_collector_errors_total",
                               type(exc).__name__, exc)
            families = []
        errors = self._errors()
        errors.add_metric([], self.errors)
        return [*families, errors]

    # -- the series ------------------------------------------------------------------------------

    @staticmethod
    def _errors():
        return CounterMetricFamily("drama3_patches_collector_errors",
                                   "Scrapes whose drama3-patches collection failed (its series left out).")

    @staticmethod
    def _families() -> list:
        labels = ["role", "stage", "rank", "host"]
        return [
            (GaugeMetricFamily("drama3_patches_patch_state",
                               "Patch state per process role: 1 for the state the patch is in, else 0.",
                               labels=["patch", "state", *labels]), "state"),
            (CounterMetricFamily("drama3_patches_events",
                                 "Runtime events the patches counted (preemptions, resumes, checks).",
                                 labels=["event", *labels]), "events"),
            (GaugeMetricFamily("drama3_patches_process_info",
                               "One per process whose report is live, with what it is.",
                               labels=[*labels, "pid", "platform", "enabled"]), "info"),
            (GaugeMetricFamily("drama3_patches_reports",
                               "Process reports by status at this scrape (folder-unset: 1 when "
                               "DRAMA3_PATCHES_REPORT_DIR is unset and only this process is exported).",
                               labels=["status"]), "reports"),
            (GaugeMetricFamily("drama3_patches_reports_skipped",
                               "Files in the report folder skipped at this scrape, by why (over-limit: "
                               "left for later scrapes; unlisted: 1 when the folder's listing was cut).",
                               labels=["reason"]), "skipped"),
        ]

    def _collect(self) -> list:
        from drama3_patches.engine import STATES, get_engine
        from drama3_patches.engine.state import EVENTS, ROLES, host_label
        from drama3_patches.report_dir import SKIP_KINDS, inherit_stages

        engine = get_engine()
        ids = set(engine.manifest.ids)
        here = host_label()
        statuses = dict.fromkeys(REPORT_STATUSES, 0)
        kinds = dict.fromkeys(SKIP_KINDS, 0)
        procs = [self._own(engine, here)]
        directory = os.environ.get(env.REPORT_DIR)
        if not directory:
            statuses["folder-unset"] = 1
        else:
            procs += self._from_folder(directory, here, statuses, kinds)
        statuses["live"] = len(procs)
        procs = inherit_stages(procs)

        families = self._families()
        out = {what: family for family, what in families}
        state_counts: dict[tuple, int] = {}
        event_counts: dict[tuple, int] = {}
        for proc in procs:
            ident = proc.get("process") or {}
            role = ident.get("role") if ident.get("role") in ROLES else OTHER
            where = (role, _number(ident.get("stage"), MAX_STAGE), _number(ident.get("rank"), MAX_RANK), here)
            platform = proc.get("platform") if proc.get("platform") in env.PLATFORMS else OTHER
            out["info"].add_metric([*where, str(proc["pid"]), platform,
                                    "true" if proc.get("enabled") is True else "false"], 1)
            for patch in proc["patches"]:
                pid_ = patch["id"] if patch["id"] in ids else OTHER
                for state in STATES:
                    key = (pid_, state, *where)
                    state_counts[key] = state_counts.get(key, 0) + (patch["state"] == state)
            counts = proc.get("counts") if isinstance(proc.get("counts"), dict) else {}
            for event in EVENTS:
                value = counts.get(event, 0)
                value = value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
                key = (event, *where)
                event_counts[key] = event_counts.get(key, 0) + value
        for key, value in state_counts.items():
            out["state"].add_metric(list(key), value)
        for key, value in event_counts.items():
            out["events"].add_metric(list(key), value)
        for status, n in statuses.items():
            out["reports"].add_metric([status], n)
        for kind, n in kinds.items():
            out["skipped"].add_metric([kind], n)
        return [family for family, _ in families]

    @staticmethod
    def _own(engine, here: str) -> dict:
        """This process (the API server) from the engine itself: always current, report folder or not."""
        from drama3_patches.engine.state import counters, process_identity

        # It serves /metrics, so it is the API server, whatever its names say.
        ident = {**process_identity(), "role": "api-server", "stage": None, "rank": None}
        return {"pid": os.getpid(), "host": here, "platform": engine.platform, "enabled": engine.enabled(),
                "counts": counters(), "process": ident,
                "patches": [{"id": i, "state": rec.state} for i, rec in engine.records.items()]}

    def _from_folder(self, directory: str, here: str, statuses: dict, kinds: dict) -> list:
        from drama3_patches import report_dir
        from drama3_patches.report_dir import collect, liveness

        try:
            collected = collect(directory, cache=self._cache, max_bytes=report_dir.SCRAPE_MAX_BYTES)
        except FileNotFoundError:  # no process has written a report yet
            return []
        for kind, n in collected.kinds.items():
            kinds[kind] += n
        # over the scrape's bound: not read this time (the newest were), counted with the skipped
        statuses["skipped"] = len(collected.skipped) + collected.kinds.get("over-limit", 0)
        out = []
        for proc in collected.processes:
            if proc.get("host") == here and proc["pid"] == os.getpid():
                continue  # this process: exported from the engine, current
            status = liveness(proc, here)
            statuses[status] += 1
            if status == "live":
                out.append(proc)
        return out


_REGISTERED: PatchCollector | None = None
_REGISTER_LOCK = threading.Lock()


def register(registry=None) -> PatchCollector:
    """Register the collector in ``registry`` (prometheus_client's default ``REGISTRY``) once per
    process; a second call returns the first collector."""
    global _REGISTERED
    with _REGISTER_LOCK:
        if _REGISTERED is None:
            if registry is None:
                from prometheus_client import REGISTRY as registry
            collector = PatchCollector()
            registry.register(collector)
            _REGISTERED = collector
        return _REGISTERED
