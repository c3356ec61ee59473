"""The engine-core agent's record of faults for its policy, kept as a worker's
``RecoveryEngine`` keeps its own (``ftengine.episode.Episode``, the same context): the fault
history, oldest first (each episode's fault, with the rank it points at once the agent
knows it, and every peer seen dead), and the episode under way. An episode opens with each
fault of the engine core's busy loop (vLLM's ``on_fault``), which only a serving engine has.
"""

from __future__ import annotations

from collections import deque

from ftengine.context import RecoveryContext, RedundancyFacts
from ftengine.episode import Episode
from ftengine.faults import Fault, FaultKind, Phase

HISTORY = 256


class FaultBooks:
    """Engine ``rank``'s (of ``world_size``) faults; mutable, used by the agent's threads
    one at a time (the busy loop opens an episode while the agent thread is not deciding:
    it decides only once vLLM's status says ``unhealthy``)."""

    def __init__(self, rank: int, world_size: int, history: int = HISTORY) -> None:
        self.rank = rank
        self.world_size = world_size
        self.history: deque[Fault] = deque(maxlen=history)
        self.episode: Episode | None = None
        self.fault: Fault | None = None  # the episode's, as the agent knows it now
        self.episodes = 0

    def open(self, fault: Fault) -> None:
        """A fault of the engine core's busy loop: a new episode."""
        self.episodes += 1
        self.episode = Episode(self.episodes, fault, fault.at)
        self.fault = fault
        self.history.append(fault)

    def settle(self, fault: Fault) -> None:
        """The episode's fault as the agent's verdict names it now (a kind, a rank learnt
        from the peers); the history shows it so, in its place."""
        old = self.fault
        if old is None or fault == old:
            return
        for i in range(len(self.history) - 1, -1, -1):
            if self.history[i] is old:
                self.history[i] = fault
                break
        self.fault = fault

    def dead(self, rank: int, now: float) -> None:
        """Peer ``rank`` seen dead during the episode: recorded once, as a dead-peer fault
        naming it (what the test bed's supervisor tells each worker); in the history only
        when the episode's own fault does not say so already (one death, one entry)."""
        episode = self.episode
        if episode is None or rank in episode.dead_ranks(frozenset()):
            return
        fault = Fault(FaultKind.DEAD_PEER, rank=rank, info=f"engine {rank} is dead", at=now)
        episode.add_fault(fault)
        own = self.fault
        if own is None or (own.kind, own.rank) != (FaultKind.DEAD_PEER, rank):
            self.history.append(fault)

    def start_attempt(self) -> int:
        """One more recovery started in the episode; its number (1 for the first)."""
        return 0 if self.episode is None else self.episode.start_attempt()

    def context(
        self,
        now: float,
        removed: frozenset[int],
        *,
        epoch: int,
        redundancy: RedundancyFacts | None,
    ) -> RecoveryContext | None:
        """What the policy sees of the episode's fault at ``now`` (None: no episode)."""
        episode, fault = self.episode, self.fault
        if episode is None or fault is None:
            return None
        return episode.context(
            fault,
            Phase.QUARANTINED,  # the agent decides while vLLM's status is unhealthy
            now,
            self.history,
            removed,
            rank=self.rank,
            world_size=self.world_size,
            epoch=epoch,
            redundancy=redundancy,
        )
