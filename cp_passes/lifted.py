"""Module forwards with an inline loop over the sequence, replaced by copies that lift the loop out
(``CPSpec.lifted_forwards``, :class:`~cp_passes.spec.LiftedForward`).

:func:`install` checks that the class's forward is the code the copy was made from (the sha256 of its source) and
sets the copy on the class, for the process, as the declared kernels are (:mod:`cp_passes.kernels`): called
outside cp_passes, the copy computes what the shipped forward does, its lifted loop run as one op.
"""

from __future__ import annotations

import hashlib
import inspect

from .errors import CPCompileError
from .kernels import resolve

_SHIPPED: dict[str, object] = {}
"""``LiftedForward.target`` -> the forward the class shipped with."""


def source_sha256(fn) -> str:
    """The first 16 hex digits of the sha256 of ``fn``'s source (through decorators that keep ``__wrapped__``)."""
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def shipped(target: str):
    """The forward ``target`` names as its class shipped it (before :func:`install` replaced it)."""
    return _SHIPPED[target] if target in _SHIPPED else resolve(target)[2]


def install(forwards) -> None:
    """Set each :class:`~cp_passes.spec.LiftedForward`'s replacement on its class, once its target is checked."""
    for lifted in forwards:
        owner, attr, current = resolve(lifted.target)
        replacement = resolve(lifted.replacement)[2]
        original = _SHIPPED.get(lifted.target, current)
        found = source_sha256(original)
        if found != lifted.source_sha256:
            raise CPCompileError(
                f"{lifted.target} is not the code {lifted.replacement} was lifted from (source sha256 {found}, the "
                f"copy's {lifted.source_sha256}): another version of the package ships another forward, and a "
                f"stale copy would compute something else. Compare the two ({inspect.getsourcefile(original)}), "
                f"carry the change into the copy and set its source_sha256, or install the version the spec names")
        _SHIPPED[lifted.target] = original
        setattr(owner, attr, replacement)
