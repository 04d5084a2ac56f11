"""Child-side code for the fork-during-build test: a module that imports nothing heavy, so the
fresh interpreter that runs it has only what ``fp8_native`` itself imports."""

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
    pid = os.fork()
    if pid == 0:
        done = threading.Event()
        threading.Thread(target=lambda: (native.load(), done.set()), daemon=True).start()
        os._exit(0 if done.wait(60) else 3)
    _, status = os.waitpid(pid, 0)
    return {"child": os.waitstatus_to_exitcode(status), "torch_at_import": torch_at_import,
            "parent_loaded": native.load() is not None}
