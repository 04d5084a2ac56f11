"""vLLM general plugin: the same activation for processes that skip ``.pth`` files.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes
(API server, engine core, workers).  Activation is idempotent, so running both
this and the ``.pth`` hook changes nothing twice.
"""

from __future__ import annotations


def register() -> None:
    from drama3_patches import env

    if not env.enabled():
        return
    try:
        from drama3_patches.engine import activate

        activate()
    except Exception as exc:  # vLLM must not die at plugin load because of us (outside STRICT)
        env.soft_failure("drama3-patches could not patch", exc)
