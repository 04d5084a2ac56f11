"""vLLM general plugin: the same activation for processes that skip ``.pth`` files.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes
(API server, engine core, workers).  Activation is idempotent, so running both
this and the ``.pth`` hook changes nothing twice.
"""

from __future__ import annotations


def register() -> None:
    from drama3_patches import env

    if env.enabled():
        from drama3_patches.engine import activate

        activate()
