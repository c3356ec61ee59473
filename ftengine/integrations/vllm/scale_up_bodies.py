"""What an orchestrator POSTs to ``/fault_tolerance/apply`` to admit restarted ranks
(``scale_up``, ftengine's extension of vLLM's API; ``engine_core/admission.py``).

Every survivor gets ``{"instruction": "scale_up", "params": {"added_dp_ranks": [r, ...]}}``;
each returning rank's server the same plus ``"dp_store"``: the survivors' current DP store,
``host:port``, as a survivor's ``GET /fault_tolerance/status`` shows it (every survivor shows
the same one). A returning rank is admissible once its own status says phase ``ready``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ftengine.commands import ADDED_KEY
from ftengine.errors import CommandRejected
from ftengine.integrations.vllm.engine_core.admission import DP_STORE_KEY, INSTRUCTION


def survivors_dp_store(status: Mapping[str, object]) -> str:
    """The ``dp_store`` of a survivor's ``/fault_tolerance/status`` answer."""
    engines = status.get("engines")
    listed = engines if isinstance(engines, list) else []
    stores = [e.get(DP_STORE_KEY) for e in listed if isinstance(e, dict)]
    found = [s for s in stores if isinstance(s, str) and s]
    if not found:
        raise CommandRejected(
            f"the survivor's status names no {DP_STORE_KEY!r} (it has rebuilt no DP group of "
            f"its own yet: only a rank that was scaled down can be admitted); got {status!r}"
        )
    return found[0]


def scale_up_bodies(
    added: Iterable[int], survivor_status: Mapping[str, object]
) -> tuple[dict[str, object], dict[str, object]]:
    """The body for every survivor and the body for every returning rank."""
    ranks = sorted(int(r) for r in added)
    survivor: dict[str, object] = {"instruction": INSTRUCTION, "params": {ADDED_KEY: ranks}}
    returning: dict[str, object] = {
        "instruction": INSTRUCTION,
        "params": {ADDED_KEY: ranks, DP_STORE_KEY: survivors_dp_store(survivor_status)},
    }
    return survivor, returning
