"""Whatever a peer's tensors make a rule raise stops at the node's boundary for that peer.

The blob checks (node/blobs.py) refuse what can be told from a blob alone. What is
left, a value no check foresaw that makes a rule raise, is found by running the rule
again, from its state as it was before the step: first without the peers that made it
raise last time (a persistent attacker costs one extra step a round), else with each
peer alone. The peers whose input makes it raise are refused for the round and the
step runs once more without them. Only a step that raises with no peer at all is the
node's own fault, and that one propagates.

While no rule raises this costs nothing: a rule never changes in place what it holds,
so its state is kept by keeping its attributes' bindings (algorithms/base.py `Rewind`),
not by copying its models and scores. When one raises, the search costs up to one step
per peer, in that round only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from meshfl.algorithms.base import Rewind

log = logging.getLogger("meshfl.node")

# Faults of the machine, not of any input: a search for the peer to blame would only
# repeat them (a GPU that ran out of memory in a rule's training).
MACHINE_FAULTS: tuple[type[BaseException], ...] = (MemoryError, torch.cuda.OutOfMemoryError)

Outcome = TypeVar("Outcome")


@dataclass
class Contained(Generic[Outcome]):
    """A rule step's outcome and the peers refused because their input made it raise."""

    outcome: Outcome
    refused: list[str]


def run_contained(
    step: Callable[[frozenset[str]], Outcome],
    peers: Iterable[str],
    rule: Any,
    where: str,
    suspects: Iterable[str] = (),
) -> Contained[Outcome]:
    """`step(admitted)` runs `rule` on the input of the `admitted` peers only; `suspects`
    are the peers refused by the last contained step, tried without first."""
    everyone = frozenset(peers)
    rewind = Rewind(rule)
    try:
        return Contained(step(everyone), [])
    except MACHINE_FAULTS:
        raise  # out of memory: the machine's fault, whoever's input was in the step
    except Exception:
        if not everyone:
            raise  # nobody else's input was in it: the node's own fault
        log.exception("%s: the rule raised on its peers' input; finding whose", where)
    for refused in _candidates(step, everyone, rewind, set(suspects) & everyone):
        admitted = everyone - set(refused)
        rewind()
        try:
            outcome = step(admitted)
        except Exception:
            if not admitted:
                raise
            continue
        log.warning(
            "%s: refused for this round, the rule raised on their input: %s",
            where,
            ", ".join(refused),
        )
        return Contained(outcome, refused)
    raise AssertionError("not reached: the last candidate admits nobody")


def _candidates(
    step: Callable[[frozenset[str]], Any],
    everyone: frozenset[str],
    rewind: Rewind,
    suspects: set[str],
) -> Iterable[list[str]]:
    """Whom to refuse, in turn: last time's culprits; the peers that make the step raise
    alone; everyone (the others only make it raise together)."""
    if suspects:
        yield sorted(suspects)
    culprits = [peer for peer in sorted(everyone) if _raises(step, peer, rewind)]
    if culprits:
        yield culprits
    yield sorted(everyone)


def _raises(step: Callable[[frozenset[str]], Any], peer: str, rewind: Rewind) -> bool:
    rewind()
    try:
        step(frozenset({peer}))
    except Exception:
        return True
    return False
