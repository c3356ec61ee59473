"""How ftengine replaces a vLLM name: :class:`Patch` (the name, the parameters the original
must have, how to make the replacement), :class:`NewMethod` (a name ftengine adds), the
marks that make installing idempotent, and :func:`apply_patches`. Which names are replaced,
and why: ``engine_core.py``, ``worker.py``, ``api_server.py`` here, by the process they run
in; ``install.py`` installs them."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ftengine.errors import ConfigError
from ftengine.integrations.vllm.messages import import_vllm

logger = logging.getLogger(__name__)

PATCHED_MARK = "__ftengine_patched__"
"""Set on each replacement: the original it wraps (so a second install changes nothing)."""


class VllmSeamMoved(ConfigError):
    """A vLLM name ftengine patches is missing or no longer has the expected parameters."""


@attrs.frozen
class Patch:
    """``module.owner.name`` replaced by ``make(original)``; ``params`` are the parameter
    names (after ``self``) the original must have for the replacement to be right."""

    module: str
    owner: str
    name: str
    params: tuple[str, ...]
    make: Callable[[Callable[..., Any]], Callable[..., Any]]

    def target(self) -> tuple[Any, Callable[..., Any]]:
        """The owning class (the module itself when ``owner`` is "") and its current
        attribute, checked against ``params``."""
        module = import_vllm(self.module)
        owner = module if not self.owner else getattr(module, self.owner, None)
        original = getattr(owner, self.name, None)
        if not (isinstance(owner, type) or owner is module) or not callable(original):
            raise VllmSeamMoved(
                f"expected {self.module}.{self.owner}.{self.name} in the installed vLLM, "
                "found none: ftengine's CPU patches need updating for this vLLM version"
            )
        original = getattr(original, PATCHED_MARK, original)
        found = tuple(inspect.signature(original).parameters)[1 if self.owner else 0 :]
        if found != self.params:
            raise VllmSeamMoved(
                f"{self.module}.{self.owner}.{self.name}: expected parameters "
                f"{self.params}, found {found}: ftengine's CPU patches need updating"
            )
        return owner, original


def unchanged(original: Callable[..., Any]) -> Callable[..., Any]:
    """A :class:`Patch`'s ``make`` for a name ftengine calls but never replaces: the patch
    only checks it (``Patch.target``)."""
    return original


def replacing(function: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A :class:`Patch`'s ``make`` that puts ``function`` in the original's place."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def replacement(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

        setattr(replacement, PATCHED_MARK, original)
        return replacement

    return make


def marked(make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Any:
    def make_marked(original: Callable[..., Any]) -> Callable[..., Any]:
        replacement = make(original)
        setattr(replacement, PATCHED_MARK, original)
        return replacement

    return make_marked


def apply_patches(patches: Sequence[Patch]) -> None:
    """Install ``patches`` (idempotent); raise :class:`VllmSeamMoved` before changing
    anything if one of them no longer fits the installed vLLM."""
    targets = [(patch, *patch.target()) for patch in patches]
    for patch, owner, original in targets:
        current = getattr(owner, patch.name)
        if getattr(current, PATCHED_MARK, None) is None:
            setattr(owner, patch.name, patch.make(original))
    logger.debug("vLLM patches installed: %s", [f"{p.owner}.{p.name}" for p in patches])


@attrs.frozen
class NewMethod:
    """``module.owner.name`` added (vLLM has none: it must still have none, or be ours);
    ``dispatch`` is the owner's method that reaches it by name, with its parameters."""

    module: str
    owner: str
    name: str
    function: Callable[..., Any]
    dispatch: Patch

    def check(self) -> Any:
        """The owner, once its dispatch fits and it has no method of this name but ours."""
        owner, _dispatch = self.dispatch.target()
        current = getattr(owner, self.name, None)
        if current is not None and current is not self.function:
            raise VllmSeamMoved(
                f"expected no {self.module}.{self.owner}.{self.name} in the installed vLLM "
                "(ftengine adds it), found one: vLLM now has its own; ftengine's "
                "scale_down needs updating"
            )
        return owner

    def install(self) -> None:
        setattr(self.check(), self.name, self.function)
