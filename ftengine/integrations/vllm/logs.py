"""ftengine's logs inside vLLM's processes: through vLLM's own handlers, ``[FT]``-prefixed
like vLLM's fault-tolerance lines, so one log shows both in order."""

from __future__ import annotations

import logging

PREFIX = "[FT] "
VLLM_LOGGER = "vllm"
FTENGINE_LOGGER = "ftengine"


class FtPrefix(logging.Filter):
    """Prefixes a record's message with ``[FT]`` once (some messages carry it already)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and not record.msg.startswith(PREFIX):
            record.msg = PREFIX + record.msg
        return True


def route_logs() -> None:
    """Send the ``ftengine`` logger's records to the ``vllm`` logger's handlers (idempotent);
    INFO and up, as vLLM logs by default."""
    ours = logging.getLogger(FTENGINE_LOGGER)
    if any(isinstance(f, FtPrefix) for f in ours.filters):
        return
    ours.addFilter(FtPrefix())
    handlers = logging.getLogger(VLLM_LOGGER).handlers
    for handler in handlers:
        ours.addHandler(handler)
    if handlers:
        ours.setLevel(logging.INFO)
        ours.propagate = False  # vLLM's handlers print it already
