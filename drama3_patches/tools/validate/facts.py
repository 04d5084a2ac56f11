"""The facts an Ascend bug report asks for, gathered into the output folder (``host-facts.md``).

Each is collected in a child process with a timeout, so a hung driver tool or mount cannot stall
validate, and is written "absent" where the host lacks it: ``npu-smi info``, the CANN toolkit's and
the driver's versions, the ``ASCEND_*`` and ``DRAMA3_*`` variables, the versions of torch,
torch-npu, vllm, vllm-ascend and vllm-omni, and ``drama3-patches doctor``'s output.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

from drama3_patches.tools import isolated_python

MAX_OUTPUT = 256 * 1024  # of each command's output kept in the report
DISTRIBUTIONS = ("torch", "torch-npu", "vllm", "vllm-ascend", "vllm-omni", "drama3-patches")
# Where the CANN toolkit and the driver say their versions (the toolkit's own variables first).
CANN_FILES = ("{ASCEND_TOOLKIT_HOME}/version.cfg", "{ASCEND_HOME_PATH}/version.cfg",
              "/usr/local/Ascend/ascend-toolkit/latest/version.cfg",
              "/usr/local/Ascend/ascend-toolkit/latest/{arch}-linux/ascend_toolkit_install.info",
              "/usr/local/Ascend/cann/latest/version.cfg")
DRIVER_FILES = ("/usr/local/Ascend/driver/version.info",)

# Runs in the child: reads the version files (bounded) and the distributions' versions.
_CHILD = r"""
import json, os, platform, sys
from drama3_patches.versions import installed_version
def first(paths):
    env = dict(os.environ, arch=platform.machine())
    for raw in paths:
        try:
            path = raw.format(**env)
        except KeyError:
            continue
        try:
            with open(path, "rb") as fh:
                return {"file": path, "text": fh.read(16384).decode("utf-8", "replace")}
        except OSError:
            continue
    return None
cann, driver, dists = json.loads(sys.argv[1])
print(json.dumps({"cann": first(cann), "driver": first(driver),
                  "versions": {d: installed_version(d) for d in dists}}))
"""


STOP_POLL_S = 0.25  # how soon a child is ended once the run is ending


def _run(argv: list, timeout: float, python: bool = False, stop: threading.Event | None = None) -> dict:
    """``argv`` run with ``timeout``; ``python``: ``argv`` is ``-c CODE ...`` or ``-m MODULE ...`` for
    an isolated Python child (isolated_python). ``stop`` set: the child is killed (the run is ending)."""
    shown = " ".join(argv)[:200]
    if stop is not None and stop.is_set():
        return {"absent": "not gathered: the run was ending"}
    command, env = (isolated_python.argv(*argv), isolated_python.environ()) if python else (argv, None)
    try:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return {"absent": f"{argv[0]} is not installed"}
    except OSError as exc:
        return {"absent": f"`{shown}` could not run: {exc}"}
    deadline = time.monotonic() + timeout
    with proc:
        while True:
            try:
                out, err = proc.communicate(timeout=STOP_POLL_S)
                break
            except subprocess.TimeoutExpired:
                ending = stop is not None and stop.is_set()
                if ending or time.monotonic() > deadline:
                    proc.kill()
                    proc.communicate()
                    return {"absent": "not gathered: the run was ending" if ending
                            else f"`{shown}` took over {timeout:g} s"}
    text = (out + err)[:MAX_OUTPUT].decode("utf-8", "replace")
    return {"exit": proc.returncode, "output": text}


def collect(timeout: float = 60.0, doctor_timeout: float = 300.0, stop: threading.Event | None = None) -> dict:
    """Every fact, each from its own child process; ``stop`` set: the rest are "absent" at once."""
    facts = {"variables": {k: v for k, v in sorted(os.environ.items())
                           if k.startswith(("ASCEND_", "DRAMA3_"))}}
    facts["npu-smi info"] = _run(["npu-smi", "info"], timeout, stop=stop)
    facts.update(probe(timeout, stop))
    facts["doctor"] = _run(["-m", "drama3_patches.tools", "doctor"], doctor_timeout, python=True, stop=stop)
    return facts


def probe(timeout: float = 60.0, stop: threading.Event | None = None) -> dict:
    """The CANN toolkit's and the driver's version files and the distributions' versions, read by
    an isolated Python child: ``{"cann": ..., "driver": ..., "versions": ...}``."""
    facts: dict = {}
    answer = _run(["-c", _CHILD, json.dumps([CANN_FILES, DRIVER_FILES, DISTRIBUTIONS])], timeout, python=True,
                  stop=stop)
    try:
        read = json.loads(answer["output"].strip().splitlines()[-1]) if answer.get("exit") == 0 else None
    except (ValueError, IndexError):
        read = None
    if read is None:
        reason = answer.get("absent") or f"the probe failed: {answer.get('output', '')[-300:]}"
        facts.update({"cann": {"absent": reason}, "driver": {"absent": reason}, "versions": {"absent": reason}})
    else:
        for key, what in (("cann", "no CANN toolkit version file"), ("driver", "no driver version file")):
            facts[key] = read[key] or {"absent": what}
        facts["versions"] = {d: v or "absent" for d, v in read["versions"].items()}
    return facts


class Background:
    """:func:`collect` in a thread, so that it overlaps the server's start-up."""

    def __init__(self) -> None:
        self.facts: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._collect, name="drama3-validate-facts", daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        try:
            self.facts = collect(stop=self._stop)
        except Exception as exc:  # a fact we could not gather is said so, never a failed validation
            self.facts = {"error": f"{type(exc).__name__}: {exc}"}

    def stop(self) -> None:
        """The run is ending: the child running now is ended, the facts not yet gathered are "absent"."""
        self._stop.set()

    def result(self, timeout: float = 400.0) -> dict:
        self._thread.join(timeout)
        return self.facts if self.facts is not None else {"error": f"not gathered within {timeout:g} s"}


def summary(facts: dict) -> dict:
    """What ``report.json`` keeps of the facts: versions, and for each other fact its first line or
    why it is absent (the whole text is in ``host-facts.md``)."""
    if "error" in facts:
        return {"error": facts["error"]}

    def first(fact: dict) -> str:
        if "absent" in fact:
            return f"absent: {fact['absent']}"
        text = (fact.get("text") or fact.get("output") or "").strip()
        return text.splitlines()[0][:200] if text else "(empty)"

    return {"versions": facts["versions"], "npu-smi info": first(facts["npu-smi info"]),
            "cann": first(facts["cann"]), "driver": first(facts["driver"]),
            "doctor_exit": facts["doctor"].get("exit"), "variables": sorted(facts["variables"])}


def markdown(facts: dict) -> str:
    """``host-facts.md``: each fact under its heading, "absent" where the host lacks it."""
    out = ["# Host facts for an Ascend bug report", "", "Gathered by `drama3-patches validate`, each in a "
           "child process with a timeout.", ""]
    if "error" in facts:
        return "\n".join(out + [f"Not gathered: {facts['error']}", ""])

    def block(title: str, fact: dict) -> None:
        out.append(f"## {title}")
        out.append("")
        if "absent" in fact:
            out.append(f"absent: {fact['absent']}")
        else:
            if "file" in fact:
                out.append(f"from `{fact['file']}`")
            if "exit" in fact:
                out.append(f"exit {fact['exit']}")
            out.extend(["", "```", (fact.get("text") or fact.get("output") or "").rstrip(), "```"])
        out.append("")

    block("npu-smi info", facts["npu-smi info"])
    block("CANN toolkit version", facts["cann"])
    block("Driver version", facts["driver"])
    out += ["## Versions", ""]
    versions = facts["versions"]
    if "absent" in versions:
        out.append(f"absent: {versions['absent']}")
    else:
        out += [f"- {d}: {v}" for d, v in versions.items()]
    out += ["", "## ASCEND_* and DRAMA3_* variables", ""]
    out += [f"- {k}={v}" for k, v in facts["variables"].items()] or ["absent: none set"]
    out.append("")
    block("drama3-patches doctor", facts["doctor"])
    return "\n".join(out)
