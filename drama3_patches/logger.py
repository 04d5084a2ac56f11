"""Loggers named under ``vllm.`` so that vLLM's logging config formats them.

vLLM configures the ``vllm`` logger (handler, format, level from
``VLLM_LOGGING_LEVEL``); a child logger propagates to it, so our lines look
like vLLM's and follow its settings, with no import of vLLM here.
"""

from __future__ import annotations

import logging


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith("vllm.") else "vllm." + name)
