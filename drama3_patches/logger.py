"""Loggers named under ``vllm.`` so that vLLM's logging config formats them.

vLLM configures the ``vllm`` logger (handler, format, level from
``VLLM_LOGGING_LEVEL``); a child logger propagates to it, so our lines look
like vLLM's and follow its settings, with no import of vLLM here.
"""

from __future__ import annotations

import logging
import threading


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith("vllm.") else "vllm." + name)


_warned: set = set()  # (logger name, key) already warned in this process
_warned_lock = threading.Lock()


def warning_once(logger: logging.Logger, key: str, msg: str, *args) -> None:
    """``logger.warning(msg, *args)`` the first time ``key`` comes to this logger in this process:
    a condition met at every call (a bad setting, every layer of a model) is one line, not many."""
    with _warned_lock:
        if (logger.name, key) in _warned:
            return
        _warned.add((logger.name, key))
    logger.warning(msg, *args)
