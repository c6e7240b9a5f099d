"""Malicious mesh members, to measure what the peer rules and their defences withstand.

An attacker is an ordinary node that keeps its key and signs every blob correctly: the
transport cannot tell it apart. It only lies in what it trains on, what it publishes as
its model and how many samples it claims. Kinds (`attack.kind`):

- `labelflip`: trains on y -> C-1-y.
- `scale:<s>`: publishes round start + s · (its update).
- `noise`: publishes Gaussian weights with each tensor's root mean square.
- `signflip`: publishes round start − (its update).
- `inflate_n:<n>`: publishes its honest model but claims n training samples.
- `replay`: publishes an honest peer's model of the round before as its own (its own
  untrained model in round 1, when there is nothing to replay).
- `freeride`: never trains; publishes its model as it is, i.e. what it aggregated from
  what it received.
- `relay:<s>`: never trains; publishes an honest peer's model of the round before (one
  drawn afresh each round from those it received) with Gaussian noise of s times each
  tensor's root mean square added: a near-copy, which no bit-for-bit check catches (a
  Sybil's way to look helpful; its own model, as aggregated, where it received no
  honest one: the untrained model in round 1).
- `collude:<k>`: the first k nodes of `attack.nodes` publish one and the same poisoned
  model (random weights of the initial model's scale, from a seed they share); any
  other attacker publishes noise of its own.

Only the whole model (blob kind "model") is tampered with; blobs a rule publishes beside
it (pFedLIA's lazy model, pFedSV's shared-body parts) stay honest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshfl.algorithms.base import MODEL, PeerModel, State, cloned, draw_seed

from .blobs import MAX_SAMPLE_COUNT  # a larger claim is refused before any rule sees it

# kind -> what its ":<value>" is: None (no value), int or float.
KINDS: dict[str, type | None] = {
    "labelflip": None,
    "scale": float,
    "noise": None,
    "signflip": None,
    "inflate_n": int,
    "replay": None,
    "freeride": None,
    "relay": float,
    "collude": int,
}
KINDS_ALLOWED = (
    "labelflip, scale:<s>, noise, signflip, inflate_n:<n>, replay, freeride, relay:<s>, collude:<k>"
)


@dataclass(frozen=True)
class AttackSpec:
    kind: str
    value: float | int | None = None


def parse_kind(text: str) -> AttackSpec:
    """`scale:10` -> AttackSpec("scale", 10.0); ValueError saying what is allowed."""
    kind, colon, raw = text.partition(":")
    if kind not in KINDS:
        raise ValueError(f"got {text!r}; allowed: {KINDS_ALLOWED}")
    value_type = KINDS[kind]
    if value_type is None:
        if colon:
            raise ValueError(f"got {text!r}; {kind} takes no value")
        return AttackSpec(kind)
    try:
        value = value_type(raw)
    except ValueError:
        raise ValueError(f"got {text!r}; allowed: {kind}:<{value_type.__name__}>") from None
    if kind == "scale" and not torch.isfinite(torch.tensor(value)):
        raise ValueError(f"got {text!r}; the scale must be a finite number")
    if kind == "relay" and not 0 <= value < float("inf"):
        raise ValueError(f"got {text!r}; the noise must be a finite number >= 0")
    if kind == "inflate_n" and not 1 <= value <= MAX_SAMPLE_COUNT:
        raise ValueError(f"got {text!r}; the claimed count must be 1 to 2**53")
    if kind == "collude" and value < 2:
        raise ValueError(f"got {text!r}; collusion needs k >= 2 attackers")
    return AttackSpec(kind, value)


# --------------------------------------------------------------------------- pure tampering


def flip_labels(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    return (num_classes - 1) - y


def scaled_update(start: State, trained: State, scale: float) -> State:
    """start + scale · (trained − start) on float tensors; counters as trained."""
    return {
        key: start[key] + scale * (value - start[key])
        if value.is_floating_point()
        else value.clone()
        for key, value in trained.items()
    }


def noise_like(state: State, generator: torch.Generator) -> State:
    """Gaussian tensors with each float tensor's root mean square (its scale), so the
    model looks like a model by size and carries nothing learned."""
    noisy = {}
    for key, value in state.items():
        if not value.is_floating_point():
            noisy[key] = value.clone()
            continue
        scale = value.double().pow(2).mean().sqrt().to(value.dtype)
        noisy[key] = torch.randn(value.shape, generator=generator, dtype=value.dtype) * scale
    return noisy


def replay_source(previous: dict[str, PeerModel], attackers: frozenset[str]) -> str | None:
    """The honest peer whose model of the round before gets replayed: the first by name."""
    honest = sorted(name for name in previous if name not in attackers)
    return honest[0] if honest else None


def with_noise(state: State, relative: float, generator: torch.Generator) -> State:
    """`state` plus Gaussian noise of `relative` times each float tensor's root mean
    square; counters as they are."""
    noise = noise_like(state, generator)
    return {
        key: value + relative * noise[key] if value.is_floating_point() else value.clone()
        for key, value in state.items()
    }


# --------------------------------------------------------------------------- a node's attack


@dataclass
class Attack:
    """What one node does wrong; `Attack()` is an honest node, every hook a no-op."""

    spec: AttackSpec | None = None
    node: str = ""
    seed: int = 0
    attackers: frozenset[str] = frozenset()
    colluders: tuple[str, ...] = ()
    initial_model: Callable[[], State] | None = None
    _start: State | None = None
    _previous: dict[str, PeerModel] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.spec is not None

    @property
    def trains(self) -> bool:
        return self.spec is None or self.spec.kind not in ("freeride", "relay")

    def training_labels(self, y: torch.Tensor, num_classes: int) -> torch.Tensor:
        if self.spec is not None and self.spec.kind == "labelflip":
            return flip_labels(y, num_classes)
        return y

    def start_round(self, model: torch.nn.Module) -> None:
        """Remember the model the round starts from: updates are measured from it."""
        if self.active:
            self._start = cloned(model.state_dict())

    def observe(self, received: dict[str, dict[str, PeerModel]]) -> None:
        """The round's received models, for a replay next round."""
        if self.active:
            self._previous = dict(received.get(MODEL, {}))

    def tamper(
        self, round_no: int, publications: dict[str, State], n_samples: int
    ) -> tuple[dict[str, State], int]:
        """The blobs and sample count this node announces instead of the honest ones."""
        if self.spec is None or MODEL not in publications:
            return publications, n_samples
        if self.spec.kind == "inflate_n":
            assert self.spec.value is not None, "inflate_n has a count"
            return publications, int(self.spec.value)
        return {**publications, MODEL: self._poisoned(round_no, publications[MODEL])}, n_samples

    def _poisoned(self, round_no: int, trained: State) -> State:
        assert self.spec is not None and self._start is not None, "start_round came first"
        kind, start = self.spec.kind, self._start
        if kind == "scale":
            assert self.spec.value is not None, "scale has a factor"
            return scaled_update(start, trained, float(self.spec.value))
        if kind == "signflip":
            return scaled_update(start, trained, -1.0)
        if kind == "noise" or (kind == "collude" and self.node not in self.colluders):
            return noise_like(trained, self._generator(round_no, self.node))
        if kind == "collude":
            assert self.initial_model is not None, "colluders share the initial model's scale"
            return noise_like(self.initial_model(), self._generator(round_no, "colluders"))
        if kind == "replay":
            source = replay_source(self._previous, self.attackers)
            return start if source is None else dict(self._previous[source].state)
        if kind == "relay":
            assert self.spec.value is not None, "relay has a noise level"
            generator = self._generator(round_no, self.node)
            honest = sorted(name for name in self._previous if name not in self.attackers)
            if not honest:
                return trained
            source = honest[int(torch.randint(len(honest), (1,), generator=generator))]
            return with_noise(self._previous[source].state, float(self.spec.value), generator)
        return trained  # labelflip (poisoned in training), freeride (never trained)

    def _generator(self, round_no: int, owner: str) -> torch.Generator:
        return torch.Generator().manual_seed(draw_seed(self.seed, owner, round_no, "attack"))


def attack_for(
    node: str, nodes: list[str], kind: str, seed: int, initial_model: Callable[[], State]
) -> Attack:
    """The attack of `node` under `attack.nodes` = `nodes` and `attack.kind` = `kind`
    (validated by the config); an honest Attack for a node not listed."""
    if node not in nodes or not kind:
        return Attack()
    spec = parse_kind(kind)
    colluders: tuple[str, ...] = ()
    if spec.kind == "collude":
        assert spec.value is not None, "collude has a group size"
        colluders = tuple(nodes[: int(spec.value)])
    return Attack(spec, node, seed, frozenset(nodes), colluders, initial_model)
