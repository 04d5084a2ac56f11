"""The patch engine, in three rooms:

- ``core``: guards and orchestration (the ``Engine``; ``PatchError``);
- ``install``: target resolution along the MRO, installation all or none,
  restore, alias rebinding, which objects are ours;
- ``state``: the records, a patch's state derived from its targets', the
  status dict and the report file.

Imported by the import trigger (``_bootstrap.HOOK``/``ACTIVATE``) once a target
module has executed, or by the package API and ``drama3-patches status``.
"""

from __future__ import annotations

import os
import threading

from drama3_patches.engine import state
from drama3_patches.engine.core import Engine, PatchError
from drama3_patches.engine.install import MARKER, TargetAbsent, resolve
from drama3_patches.engine.state import ALONGSIDE, APPLIED, FAILED, NOT_NEEDED, PENDING, SKIPPED, STATES, write_report

__all__ = [
    "ALONGSIDE", "APPLIED", "Engine", "FAILED", "MARKER", "NOT_NEEDED", "PENDING", "PatchError",
    "SKIPPED", "STATES", "TargetAbsent", "activate", "get_engine", "on_import", "resolve", "write_report",
]

_ENGINE: Engine | None = None
_ENGINE_LOCK = threading.Lock()


def _new_locks_in_child() -> None:
    # A lock another thread held at fork() stays held forever in the child (that thread
    # does not exist there): every lock of the engine is made anew.
    global _ENGINE_LOCK
    _ENGINE_LOCK = threading.Lock()
    if _ENGINE is not None:
        _ENGINE.new_locks()


os.register_at_fork(after_in_child=_new_locks_in_child)


def get_engine() -> Engine:
    global _ENGINE
    if _ENGINE is None:
        with _ENGINE_LOCK:
            if _ENGINE is None:
                _ENGINE = Engine()
    return _ENGINE


# The counts' writer (``state.flush_counts``) finds the engine through this, never by importing
# this package back.
state.engine_source = get_engine


def on_import(module_name: str) -> None:
    """The import trigger's hook (``_bootstrap.HOOK``)."""
    get_engine().on_import(module_name)


def activate() -> None:
    """Activation by the ``.pth`` hook or the vLLM plugin (``_bootstrap.ACTIVATE``)."""
    get_engine().activate()
