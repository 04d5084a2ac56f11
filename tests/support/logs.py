"""Log lines of the patches, captured where pytest's ``caplog`` cannot see them: vLLM's logging
set-up stops the ``vllm`` logger tree from propagating to the root logger, where caplog listens."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

PATCHES_LOGGER = "vllm.drama3_patches"


class _Lines(logging.Handler):
    def __init__(self, lines: list) -> None:
        super().__init__(logging.DEBUG)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def captured(name: str = PATCHES_LOGGER, level: int = logging.INFO) -> Iterator[list[str]]:
    """The messages logged under ``name`` (and its children) at ``level`` or above inside the block."""
    logger = logging.getLogger(name)
    lines: list[str] = []
    handler = _Lines(lines)
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)
