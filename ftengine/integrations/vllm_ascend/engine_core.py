"""Whether ftengine's engine-core half fits the installed vLLM, checked before an Ascend worker
starts, so that a vLLM it cannot patch stops start-up instead of quietly running without it.

ftengine's sentinel on a vLLM-Ascend worker relies on its engine-core patches
(``integrations.vllm.patches``: idle detection, re-inference, the status fields,
``scale_down``). vLLM's plugin loader installs them in every process and, when one no longer
fits, only logs it: the workers would run ftengine's sentinel with no engine-core half. The
known case is vLLM PR #46370 (adds ``EngineCoreSentinel.scale_down``, replaces
``_reinit_dp_group`` with ``_reinit_groups`` and sends the workers a ``query_mask``
instruction ftengine does not answer): docs/ascend.md's recipe does not merge it, and a vLLM
that carries it is refused here, naming the way out.
"""

from __future__ import annotations

from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.patches.engine_core import (
    CORE_SENTINEL_MODULE,
    ENGINE_CORE_PATCHES,
    SCALE_DOWN_METHOD,
)
from ftengine.integrations.vllm.patches.mechanism import VllmSeamMoved

UPSTREAM_SCALE_DOWN_PR = "vLLM PR #46370"
UPSTREAM_SCALE_DOWN_SEAMS = ("scale_down", "_reinit_groups")
"""``EngineCoreSentinel`` methods that PR adds (ftengine adds a ``scale_down`` of its own)."""


def engine_core_problems() -> tuple[str, ...]:
    """Every engine-core seam ftengine needs that the installed vLLM moved (empty: none)."""
    problems = []
    for patch in ENGINE_CORE_PATCHES:
        try:
            patch.target()
        except VllmSeamMoved as exc:
            problems.append(str(exc))
    try:
        SCALE_DOWN_METHOD.check()
    except VllmSeamMoved as exc:
        problems.append(str(exc))
    return tuple(problems)


def carries_upstream_scale_down() -> bool:
    """Whether vLLM's engine-core sentinel has a seam of PR #46370 that is not ftengine's."""
    sentinel = getattr(import_vllm(CORE_SENTINEL_MODULE), SCALE_DOWN_METHOD.owner, None)
    return any(
        getattr(sentinel, name, None) not in (None, SCALE_DOWN_METHOD.function)
        for name in UPSTREAM_SCALE_DOWN_SEAMS
    )


def require_engine_core() -> None:
    """Raise :class:`VllmSeamMoved` (before the NPU is touched) unless ftengine's
    engine-core patches fit the installed vLLM."""
    problems = engine_core_problems()
    if not problems:
        return
    cause = (
        f"this vLLM carries {UPSTREAM_SCALE_DOWN_PR} (EngineCoreSentinel.scale_down / "
        "_reinit_groups, and a query_mask instruction to the workers), which ftengine's "
        "engine-core patches do not support yet"
        if carries_upstream_scale_down()
        else "this vLLM moved names ftengine's engine-core patches replace"
    )
    raise VllmSeamMoved(
        f"[FT] {cause}: ftengine's worker sentinel would run without its engine-core half "
        "(no idle detection, re-inference, status fields or scale_down). Build vLLM without "
        f"{UPSTREAM_SCALE_DOWN_PR} as docs/ascend.md does (ftengine brings its own "
        "scale_down), or leave ftengine_ascend out of VLLM_PLUGINS to run vLLM-Ascend's own "
        "sentinel. Problems: " + "; ".join(problems)
    )
