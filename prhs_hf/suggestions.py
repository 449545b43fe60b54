""""Did you mean ...?" for a mistyped name: one helper for every list of names a user picks from
(config names, registered models and data sets). No imports beyond the standard library, so a
command line can refuse a name before it imports torch."""

from __future__ import annotations

import difflib
from typing import Iterable

__all__ = ["closest_name", "did_you_mean"]


def closest_name(name: str, choices: Iterable[str]) -> str | None:
    """The one of ``choices`` closest to ``name`` (letter case aside; :func:`difflib.get_close_matches`
    with its default cutoff), or ``None`` when none is close.

    >>> closest_name("cis_longbnech", ["cis", "cis_longbench", "cpe_longbench"])
    'cis_longbench'
    """
    by_folded = {choice.casefold(): choice for choice in choices}
    close = difflib.get_close_matches(name.strip().casefold(), list(by_folded), n=1)
    return by_folded[close[0]] if close else None


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"did you mean 'X'? "`` for the :func:`closest_name` ``X``, or ``""``: the start of a sentence
    that goes on to list what is allowed."""
    closest = closest_name(name, choices)
    return "" if closest is None else f"did you mean {closest!r}? "
