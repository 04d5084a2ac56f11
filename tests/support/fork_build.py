"""Child-side code for the fork-during-build tests of the native fp8 kernel. The module imports
nothing heavy, so a fresh interpreter that runs it has only what ``fp8_native`` itself imports."""

from __future__ import annotations

import os
import sys
import threading
import time


def fork_one_second_into_a_slow_build() -> dict:
    """Start load() in a thread (the compiler, $CC, sleeps before compiling), fork a second later,
    and let the child load too; its exit code is 3 when its load() had not returned after 60 s."""
    from drama3_patches.kernels import fp8_native as native

    torch_at_import = "torch" in sys.modules
    threading.Thread(target=native.load, daemon=True).start()
    time.sleep(1.0)
    return {"child": fork_and_load(native, 60), "torch_at_import": torch_at_import,
            "parent_loaded": native.load() is not None}


def fork_and_load(native, seconds: float) -> int:
    """Fork; the child calls ``native.load()`` in a thread and exits 0 when it returned within
    ``seconds``, 3 when not (so a deadlocked child fails the test rather than hangs it). Returns
    the child's exit code."""
    pid = os.fork()
    if pid == 0:
        done = threading.Event()
        threading.Thread(target=lambda: (native.load(), done.set()), daemon=True).start()
        os._exit(0 if done.wait(seconds) else 3)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
