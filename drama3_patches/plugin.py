"""vLLM general plugin: the same activation for processes that skip ``.pth`` files.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes
(API server, engine core, workers).  Activation is idempotent, so running both
this and the ``.pth`` hook changes nothing twice.
"""

from __future__ import annotations


def register() -> None:
    from drama3_patches import _bootstrap, env

    if env.enabled():
        _bootstrap.note_activation("plugin")
        # the .pth hook's own call: outside STRICT an error of ours is one warning, never vLLM's
        _bootstrap._call(_bootstrap.ACTIVATE)
