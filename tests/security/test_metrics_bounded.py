"""What another local user's files in the report folder may cost a ``/metrics`` scrape (issue 41,
items 7 and 9).

prometheus_client's ASGI app runs the collector on the API server's event loop: a slow scrape
blocks serving. The attacker (uid 65534) can write the folder, as anybody can write ``/tmp``; the
costs are counted, never timed: the bytes this process read (``rchar`` of ``/proc/self/io``, the
kernel's count, whatever code does the reading), the folder entries handed out by the listing,
the files opened.
"""

from __future__ import annotations

import json
import os

import pytest

from support.nobody import as_nobody, shared  # noqa: F401 (a fixture)

MIB = 1 << 20


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("rchar:")).split()[1])


def _report(pid: int, pad: int = 0) -> str:
    return json.dumps({"pid": pid, "platform": "cpu", "enabled": True,
                       "patches": [{"id": "selftest", "state": "applied", "reason": "x" * pad}]})


def plant_big_reports(folder: str, count: int) -> None:
    """As the attacker: ``count`` report-named files of just under 1 MiB (sparse)."""
    from drama3_patches.engine.state import host_label

    for i in range(count):
        with open(os.path.join(folder, f"{host_label()}-{10_000 + i}.json"), "wb") as fh:
            fh.truncate(MIB - 1)


def plant_names(folder: str, count: int) -> None:
    """As the attacker: ``count`` empty files."""
    for i in range(count):
        open(os.path.join(folder, f"planted-{i}.json"), "wb").close()


@pytest.mark.forked
def test_a_foreign_report_is_refused_before_a_byte_of_it_is_read(tmp_path, shared):
    from drama3_patches.engine.state import host_label
    from drama3_patches.report_dir import collect

    folder = shared  # the report folder, as writable as /tmp
    as_nobody(plant_big_reports, str(folder), 50)
    own = folder / f"{host_label()}-{os.getpid()}.json"
    own.write_text(_report(os.getpid()))
    collect(str(tmp_path))  # imports and the like, before counting
    before = _rchar()
    got = collect(str(folder))
    read = _rchar() - before
    assert [p["pid"] for p in got.processes] == [os.getpid()]
    assert got.kinds == {"foreign-owner": 50}, got.kinds
    assert read < own.stat().st_size + 64 * 1024, f"{read} bytes read for 50 foreign files"
    # Negative control: the counter sees a whole file read (one of them made root's).
    control = next(p for p in folder.iterdir() if p != own)
    os.chown(control, 0, 0)
    before = _rchar()
    collect(str(folder))
    assert _rchar() - before >= MIB - 1


@pytest.mark.forked
def test_the_folder_listing_stops_at_its_bound_and_says_so(shared, monkeypatch):
    import drama3_patches.report_dir as report_dir

    folder = shared
    as_nobody(plant_names, str(folder), 400)
    monkeypatch.setattr(report_dir, "MAX_LISTED", 100, raising=False)
    handed = []
    real_scandir, real_listdir = os.scandir, os.listdir

    class Counted:
        def __init__(self, it):
            self.it = it

        def __enter__(self):
            self.it.__enter__()
            return self

        def __exit__(self, *exc):
            return self.it.__exit__(*exc)

        def __iter__(self):
            for entry in self.it:
                handed.append(entry.name)
                yield entry

    monkeypatch.setattr(os, "scandir", lambda path=".": Counted(real_scandir(path)))
    monkeypatch.setattr(os, "listdir", lambda path=".": handed.extend(real_listdir(path)) or real_listdir(path))
    got = report_dir.collect(str(folder))
    assert 0 < len(handed) <= 101, len(handed)  # the bound, and the one entry that shows there are more
    assert got.kinds.get("unlisted") == 1 and got.kinds.get("foreign-owner") == len(handed) - 1, got.kinds
    assert any("not looked at" in note for note in got.notes), got.notes


def _aged_reports(folder, count: int, pad: int) -> list:
    """``count`` reports of this user, the later-named the newer: the first names are the oldest.
    Their pids, newest first."""
    from drama3_patches.engine.state import host_label

    pids = []
    for i in range(count):
        pid = 4_000_000 + i  # above any pid_max: never a running process
        path = folder / f"{host_label()}-{pid}.json"
        path.write_text(_report(pid, pad))
        os.utime(path, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
        pids.append(pid)
    return pids[::-1]


@pytest.mark.forked
def test_past_the_file_bound_the_newest_reports_are_the_ones_read(tmp_path, monkeypatch):
    import drama3_patches.report_dir as report_dir

    folder = tmp_path / "reports"
    folder.mkdir()
    newest_first = _aged_reports(folder, 6, 0)
    monkeypatch.setattr(report_dir, "MAX_REPORT_FILES", 3)
    got = report_dir.collect(str(folder))
    assert sorted(p["pid"] for p in got.processes) == sorted(newest_first[:3])
    assert got.kinds == {"over-limit": 3}, got.kinds
    # Negative control: below the bound every report is read.
    monkeypatch.setattr(report_dir, "MAX_REPORT_FILES", 6)
    assert len(report_dir.collect(str(folder)).processes) == 6


@pytest.mark.forked
def test_a_scrape_reads_at_most_its_byte_budget_newest_first_and_the_next_scrape_goes_on(tmp_path):
    """Reports of this user (none an attacker could make) of 100,000 bytes each; a budget of 350,000:
    three are read, the newest, and the rest counted; the next collection, with the first three
    cached, reads the next three."""
    from drama3_patches.report_dir import Cache, collect

    folder = tmp_path / "reports"
    folder.mkdir()
    newest_first = _aged_reports(folder, 10, 100_000)
    cache = Cache()
    collect(str(tmp_path))
    before = _rchar()
    first = collect(str(folder), cache=cache, max_bytes=350_000)
    read = _rchar() - before
    assert sorted(p["pid"] for p in first.processes) == sorted(newest_first[:3])
    assert first.kinds == {"over-limit": 7}, first.kinds
    assert 300_000 <= read <= 350_000 + 16 * 1024, read
    second = collect(str(folder), cache=cache, max_bytes=350_000)
    assert sorted(p["pid"] for p in second.processes) == sorted(newest_first[:6])
    assert second.kinds == {"over-limit": 4}, second.kinds
    # Negative control: without a budget every report is read.
    assert len(collect(str(folder)).processes) == 10


@pytest.mark.forked
def test_the_collector_exports_what_a_scrape_left_unread(tmp_path, monkeypatch):
    pytest.importorskip("prometheus_client", reason="the collector is prometheus_client's (vLLM's dependency)")
    import drama3_patches.report_dir as report_dir
    from drama3_patches.metrics import PatchCollector

    folder = tmp_path / "reports"
    folder.mkdir()
    _aged_reports(folder, 10, 100_000)
    monkeypatch.setenv("DRAMA3_PATCHES_REPORT_DIR", str(folder))
    monkeypatch.setenv("DRAMA3_PATCHES_PLATFORM", "cpu")
    monkeypatch.setattr(report_dir, "SCRAPE_MAX_BYTES", 350_000, raising=False)
    families = list(PatchCollector().collect())
    skipped = {s.labels["reason"]: s.value for f in families for s in f.samples
               if s.name == "drama3_patches_reports_skipped"}
    reports = {s.labels["status"]: s.value for f in families for s in f.samples if s.name == "drama3_patches_reports"}
    assert skipped.get("over-limit") == 7, skipped
    # the three read name processes that are not running: gone; the seven unread are skipped
    assert (reports["gone"], reports["skipped"]) == (3, 7), reports
