"""The one way tests start a fresh interpreter (the project importable, the shell's
DRAMA3_PATCHES* variables dropped).

Most isolation needs only a fresh module state, which ``@pytest.mark.forked`` gives. A fresh
interpreter is for what a fork cannot give: start-up behaviour (the ``.pth`` hook and the
environment it reads), a sys.path that must hold before modules the parent already imported,
and a parent that must not load a device runtime before it forks.

* :func:`call` runs a module-level function of a test or support module in a fresh interpreter
  and returns what it returned (JSON): child code stays real Python.
* :func:`run_cli` runs ``drama3-patches ARGV``, :func:`run_pytest` a pytest run of the suite's
  own tiers; :func:`run_python` runs a short ``python -c`` snippet, for the few children that
  are about interpreter start itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
_TAG = "DRAMA3_TEST_RESULT "


class ChildFailed(AssertionError):
    """A child exited non-zero; ``proc`` holds its streams."""

    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        super().__init__(
            f"child exited {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
        self.proc = proc

    @property
    def last_error(self) -> str:
        """The child's last non-empty stderr line (``ImportError: ...`` for a failed import)."""
        lines = [ln.strip() for ln in self.proc.stderr.splitlines() if ln.strip()]
        return lines[-1] if lines else f"exit status {self.proc.returncode}"


def child_env(env: dict | None = None, pythonpath: list | None = None) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DRAMA3_PATCHES")}
    paths = [str(p) for p in (pythonpath or [])] + [str(ROOT)]
    if base.get("PYTHONPATH"):
        paths.append(base["PYTHONPATH"])
    base["PYTHONPATH"] = os.pathsep.join(paths)
    base.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    base.update({k: str(v) for k, v in (env or {}).items()})
    return base


def _run(argv: list, env, pythonpath, timeout, check, cwd=None) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, env=child_env(env, pythonpath), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)
    if check and proc.returncode != 0:
        raise ChildFailed(proc)
    return proc


def run_python(code: str, env: dict | None = None, pythonpath: list | None = None,
               timeout: float = 300, check: bool = True, args: list | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in ``python -c``; with ``check`` a non-zero exit fails with both streams shown."""
    return _run([sys.executable, "-c", textwrap.dedent(code), *(args or [])], env, pythonpath, timeout, check)


def run_cli(*argv: str, env: dict | None = None, pythonpath: list | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """``drama3-patches ARGV`` as a fresh process (through ``python -m``, so no install is needed)."""
    return _run([sys.executable, "-m", "drama3_patches.tools", *argv], env, pythonpath, timeout, False)


def run_pytest(*argv: str, env: dict | None = None, pythonpath: list | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """``pytest ARGV`` from the project root (its setup.cfg), as a fresh process."""
    return _run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *argv], env, pythonpath, timeout,
                False, cwd=ROOT)


def call(func, *args, env: dict | None = None, pythonpath: list | None = None, timeout: float = 300,
         prelude=None, with_output: bool = False):
    """``func(*args)`` in a fresh interpreter; returns its JSON-able result.

    ``func`` is a module-level function; the child loads its file (a test module or a support
    module) by path, so the module's own imports run there first. ``prelude``, another such
    function, runs before that (for set-up that must precede every import of the module).
    ``pythonpath`` entries come first on the child's path, then the project and ``tests/``.
    A failure in the child fails the caller with the child's traceback (:class:`ChildFailed`).
    ``with_output``: ``{"result": ..., "output": the child's stdout and stderr, "stderr": its
    stderr alone}`` instead.
    """
    spec = [_address(func), _address(prelude) if prelude else None, list(args)]
    proc = _run([sys.executable, "-m", "support.subproc", json.dumps(spec)], env,
                [*(pythonpath or []), TESTS], timeout, True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_TAG)]
    if not lines:
        raise AssertionError(f"the child returned nothing\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    result = json.loads(lines[-1][len(_TAG):])
    return {"result": result, "output": proc.stdout + proc.stderr, "stderr": proc.stderr} if with_output else result


def call_ranks(func, world_size: int, *args, env: dict | None = None, pythonpath: list | None = None,
               timeout: float = 600) -> list:
    """``func(*args)`` in ``world_size`` fresh interpreters at once, one per rank of a process
    group; returns their results by rank. Each child finds its rank, the world size and a shared
    ``file://`` rendezvous in ``DRAMA3_TEST_RANK``, ``DRAMA3_TEST_WORLD`` and ``DRAMA3_TEST_INIT``
    (``support.vllm_state.join_tp_group`` reads them). A child that fails fails the caller with its
    streams; the others are stopped."""
    import tempfile

    spec = json.dumps([_address(func), None, list(args)])
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        # Each child writes to files, not pipes: a rank blocked on a full pipe that nobody reads
        # (its peer's is read first) would hide its real error behind the timeout.
        outs = [(open(f"{tmp}/{rank}.out", "w+"), open(f"{tmp}/{rank}.err", "w+")) for rank in range(world_size)]
        procs = [subprocess.Popen(
            [sys.executable, "-m", "support.subproc", spec], stdout=out, stderr=err, text=True,
            env=child_env({**(env or {}), "DRAMA3_TEST_RANK": rank, "DRAMA3_TEST_WORLD": world_size,
                           "DRAMA3_TEST_INIT": init}, [*(pythonpath or []), TESTS]))
            for rank, (out, err) in enumerate(outs)]
        results = []
        try:
            for rank, (proc, (out, err)) in enumerate(zip(procs, outs)):
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    err.seek(0)
                    raise AssertionError(f"rank {rank} still running after {timeout} s; its stderr ends:\n"
                                         f"{err.read()[-4000:]}") from None
                out.seek(0)
                err.seek(0)
                done = subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
                if proc.returncode != 0:
                    raise ChildFailed(done)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith(_TAG)]
                if not lines:
                    raise ChildFailed(done)
                results.append(json.loads(lines[-1][len(_TAG):]))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for out, err in outs:
                out.close()
                err.close()
    return results


def _address(func) -> list:
    if "<locals>" in func.__qualname__:
        raise ValueError(f"{func.__qualname__} is not module-level: a fresh interpreter cannot find it")
    return [str(Path(func.__code__.co_filename).resolve()), func.__qualname__]


def _load(path: str, qualname: str):
    name = Path(path).stem
    module = sys.modules.get(name)
    if module is None or getattr(module, "__file__", None) != path:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    target = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _leave_process_group() -> None:
    """Tear down a rank's process groups before the interpreter exits: a gloo group still alive at
    exit can abort the process in its destructor ("terminate called without an active exception",
    exit -6) after the rank's result was printed."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is not None:
        state.destroy_model_parallel()
        state.destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()


def _child_main(argv: list) -> None:
    (path, qualname), prelude, args = json.loads(argv[0])
    if prelude:
        _load(*prelude)()
    result = _load(path, qualname)(*args)
    print(_TAG + json.dumps(result), flush=True)
    if os.environ.get("DRAMA3_TEST_RANK") is not None:
        try:
            _leave_process_group()
        except Exception as exc:  # the result is out: a teardown problem is shown, not failed on
            print(f"process group teardown: {exc!r}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
