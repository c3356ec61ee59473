"""Test helpers for the cluster's serving loop: a listener that collects a request's events."""

from __future__ import annotations

import threading

from ftengine.testbed.serving_api import TokenEvent


class Collected:
    """A listener that keeps a request's events and signals its last one."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.events: list[TokenEvent] = []
        self.done = threading.Event()

    def __call__(self, event: TokenEvent) -> None:
        self.events.append(event)
        if event.finished:
            self.done.set()

    def wait(self) -> TokenEvent:
        """The last event, once it came (fails the test after ``wait_s``)."""
        assert self.done.wait(self.wait_s), f"request never finished: {self.events}"
        return self.events[-1]

    @property
    def tokens(self) -> list[int]:
        return [token for event in self.events for token in event.token_ids]
