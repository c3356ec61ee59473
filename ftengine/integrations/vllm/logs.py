"""ftengine's logs inside vLLM's processes: through vLLM's own handlers, ``[FT]``-prefixed
like vLLM's fault-tolerance lines, so one log shows both in order."""

from __future__ import annotations

import copy
import logging

PREFIX = "[FT] "
VLLM_LOGGER = "vllm"
FTENGINE_LOGGER = "ftengine"


def prefixed(record: logging.LogRecord) -> logging.LogRecord:
    """A copy of ``record`` whose message starts with ``[FT]`` (once)."""
    if isinstance(record.msg, str) and record.msg.startswith(PREFIX):
        return record
    out = copy.copy(record)
    out.msg = f"{PREFIX}{record.msg}"
    return out


class FtHandler(logging.Handler):
    """Hands ``[FT]``-prefixed copies of ftengine's records to one of vLLM's handlers (a
    logger's filters do not see its children's records; a handler sees them all)."""

    def __init__(self, target: logging.Handler) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        self.target.handle(prefixed(record))


def route_logs() -> None:
    """Send the ``ftengine`` logger's records to the ``vllm`` logger's handlers (idempotent);
    INFO and up, as vLLM logs by default."""
    ours = logging.getLogger(FTENGINE_LOGGER)
    if any(isinstance(h, FtHandler) for h in ours.handlers):
        return
    handlers = logging.getLogger(VLLM_LOGGER).handlers
    for handler in handlers:
        ours.addHandler(FtHandler(handler))
    if handlers:
        ours.setLevel(logging.INFO)
        ours.propagate = False  # vLLM's handlers print it already
