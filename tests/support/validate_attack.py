"""``drama3-patches validate`` run as root in a fresh interpreter, with another local user acting
at a chosen moment of the run: the security tests' harness (tests/security).

The server is a stand-in ``vllm`` (a shell script) that records the checkpoint it was given and
the pids of its leader and of a child that ignores the stop signals, then exits at once
(``FAKE_MODE=exit``) or waits like a server (``wait``). The host check (``preflight.check``) and
the tiny model (``tiny_model.make``, a one-file stand-in) are replaced, so a run takes seconds on
any host; the attack runs as the hostile user, by ``sh -c``, at the host check (``"preflight"``)
or once the model is made (``"model"``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import threading
import time
from pathlib import Path

FAKE_VLLM = """\
#!/bin/sh
# A stand-in for `vllm serve MODEL ...`: which checkpoint it was given, its pids, then exit or wait.
cat "$2/config.json" > "$FAKE_DIR/served.json" 2>/dev/null
echo $$ > "$FAKE_DIR/leader.pid"
( trap '' INT TERM HUP; exec sleep 300 ) &
echo $! > "$FAKE_DIR/child.pid"
if [ "$FAKE_MODE" = wait ]; then exec sleep 300; fi
exit 1
"""

DEPLOY = """\
stages:
  - stage_id: 0
    tensor_parallel_size: 1
    enforce_eager: true
  - stage_id: 1
"""


def setup(fake_dir: Path) -> None:
    """The stand-in ``vllm``, a model folder and a deploy file in ``fake_dir`` (root's, private)."""
    (fake_dir / "vllm").write_text(FAKE_VLLM)
    (fake_dir / "vllm").chmod(0o755)
    (fake_dir / "model").mkdir()
    (fake_dir / "model" / "config.json").write_text(json.dumps({"who": "the operator's --model"}))
    (fake_dir / "deploy.yaml").write_text(textwrap.dedent(DEPLOY))


def argv(fake_dir: Path, out: Path, *extra: str) -> list:
    """validate's command line against the stand-in: its deploy file, ``out``, short waits."""
    return ["validate", "--deploy", str(fake_dir / "deploy.yaml"), "--out", str(out), "--start-timeout", "60",
            "--stop-grace", "1", "--no-profile", *extra]


def as_user(uid: int, gid: int, script: str) -> None:
    """``script`` run by ``sh -c`` as ``uid``:``gid`` (no other groups); AssertionError if it fails."""
    done = subprocess.run(["/bin/sh", "-c", script], user=uid, group=gid, extra_groups=[], cwd="/",
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise AssertionError(f"the attack failed as uid {uid}: {script!r}: {done.stderr}")


def run_validate(fake_dir: str, argv: list, attack: dict | None = None, stop_at_host_check: bool = False,
                 term_in_start: bool = False) -> dict:
    """The child: ``drama3-patches validate ARGV`` against the stand-in. ``attack``: ``{"when":
    "preflight" | "model", "uid", "gid", "script"}``. ``stop_at_host_check``: the host check ends
    the run (exit 2). ``term_in_start``: a SIGTERM to this process right after the server's fork,
    with a thread of this process started earlier (as numpy's and torch's are)."""
    from drama3_patches.tools import main, tiny_model
    from drama3_patches.tools.files import InputError
    from drama3_patches.tools.validate import preflight, server

    fake = Path(fake_dir)
    reached: list[str] = []
    server.vllm_command = lambda: str(fake / "vllm")

    def attack_at(when: str) -> None:
        if attack and attack["when"] == when:
            as_user(attack["uid"], attack["gid"], attack["script"])
            reached.append(f"attacked at {when}")

    def host_check(**kwargs) -> None:
        reached.append("host check")
        if stop_at_host_check:
            raise InputError("the test's stand-in host check ended the run here")
        attack_at("preflight")

    def make(directory, *args, **kwargs):
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps({"who": "validate's tiny model"}))
        attack_at("model")
        return d

    preflight.check = host_check
    tiny_model.make = make
    if term_in_start:
        real_start = server.start
        threading.Thread(target=time.sleep, args=(120,), daemon=True).start()

        def start(*args, **kwargs):
            srv = real_start(*args, **kwargs)
            deadline = time.monotonic() + 60
            while not (fake / "child.pid").exists() and time.monotonic() < deadline:  # the stand-in is up
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)  # to the process: any thread not blocking it takes it
            for _ in range(100):  # Python code runs here, where a handler raises
                time.sleep(0.002)
            return srv

        server.start = start
    code = main(argv)
    return {"exit": code, "reached": reached}
