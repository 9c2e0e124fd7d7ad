"""Why a matcher found no pattern: a typed failure, as Inductor's pattern matcher returns ``FailedMatch``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FailedMatch:
    """A matcher's answer when the nodes are not its pattern: falsy, and its text is the reason (which the
    rules quote in their refusals word for word)."""

    reason: str

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return self.reason
