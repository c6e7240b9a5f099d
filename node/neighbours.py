"""Whom a node of a bounded mesh drops from its neighbours after a round (WIRE.md 7.7).

Each round a node rates its neighbours by what they did for it (the rule's `benefits`:
screening's evidence records, which add up over rounds, or else the rule's own
weights). It drops every neighbour whose record keeps it out (the rule `shuns` it), and
when its view is full and none is, the one that did least. The endpoint then greets as
many candidates from its passive view, so exploring never stops: a node recovers from a
bad start, and newcomers get tried (PENS, Onoszko et al. 2021). With `random` a random
neighbour is dropped instead: gossip learning, the baseline to beat.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping


def neighbours_to_drop(
    benefit: Mapping[str, float],
    shunned: Collection[str],
    select: str,
    rng: random.Random,
    explore: bool = True,
) -> list[str]:
    """The neighbours to drop, given each one's `benefit` (higher is better): the
    shunned ones, else (when `explore`: the view is full) one by `select`."""
    kept_out = sorted(peer for peer in benefit if peer in shunned)
    if kept_out or not explore or not benefit:
        return kept_out
    if select == "random":
        return [rng.choice(sorted(benefit))]
    # Ties (a round that told neighbours apart by nothing) are broken at random.
    return [min(benefit, key=lambda peer: (benefit[peer], rng.random()))]
