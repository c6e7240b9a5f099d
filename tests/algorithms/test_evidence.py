"""A peer's record: evidence of harm or help that adds up across rounds."""

from __future__ import annotations

import pytest
import torch

from meshfl.algorithms.evidence import (
    BENEFIT_CLIP,
    HARM_BOUND,
    HARM_CLIP,
    PASS_OVER_BOUND,
    PeerRecords,
    harm_z,
    sign_z,
)

VAL = 30  # a small val split: one sample is 3.3 points


def differences(mean: float, spread: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Per-sample loss differences of a mean of exactly `mean` standard errors."""
    noise = torch.randn(VAL, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    noise = (noise - noise.mean()) / noise.std() * spread
    return noise + mean * spread / VAL**0.5


def test_one_rounds_evidence_is_the_mean_in_standard_errors_clipped():
    assert abs(harm_z(differences(1.5)) - 1.5) < 1e-9
    assert harm_z(differences(40.0)) == HARM_CLIP
    assert harm_z(differences(-40.0)) == -BENEFIT_CLIP
    assert harm_z(torch.tensor([0.1, float("nan")])) == HARM_CLIP
    assert harm_z(torch.zeros(VAL)) == 0.0
    assert harm_z(torch.full((VAL,), 1e-4)) < 0.1, "consistent, and far too small to matter"
    assert harm_z(torch.empty(0)) == 0.0
    # With no floor, differences all alike have no spread: their sign decides.
    assert harm_z(torch.full((VAL,), 1e-6), negligible=0.0) == HARM_CLIP
    assert harm_z(torch.full((VAL,), -1e-6), negligible=0.0) == -BENEFIT_CLIP
    assert harm_z(torch.zeros(VAL), negligible=0.0) == 0.0


def test_the_signs_evidence_counts_samples_worsened_against_samples_bettered():
    assert sign_z(torch.tensor([0.5] * 25 + [-0.5] * 5)) == pytest.approx(20 / 30**0.5)
    assert sign_z(torch.tensor([0.5] * 15 + [-0.5] * 15)) == 0.0, "as many each way"
    assert sign_z(torch.tensor([0.5] * 20 + [0.0] * 10)) == pytest.approx(20 / 20**0.5), (
        "ties are no evidence either way"
    )
    assert sign_z(torch.full((VAL,), 1e-4)) == 0.0, "consistent, and far too small to matter"
    assert sign_z(torch.tensor([0.1] * 29 + [-9.0])) == 0.0, "a mean of help is not harm"
    assert sign_z(torch.empty(0)) == 0.0


def test_clear_harm_is_kept_out_in_the_round_it_shows():
    records = PeerRecords()
    records = records.observe("attacker", 1, differences(25.0))
    assert records.harmful("attacker")


def test_a_new_peer_is_out_when_one_round_shows_harm_beyond_the_noise():
    records = PeerRecords()
    records = records.observe("harmful", 1, differences(HARM_BOUND + 0.2))
    records = records.observe("noisy", 1, differences(HARM_BOUND - 0.2))
    assert records.harmful("harmful") and not records.harmful("noisy")


def test_one_unlucky_round_does_not_shut_out_a_peer_that_has_been_helping():
    records = PeerRecords()
    for round_no in range(1, 6):
        records = records.observe("useful", round_no, differences(-2.0, seed=round_no))
    records = records.observe("useful", 6, differences(1.8, seed=6))  # a one-round test: out
    assert not records.harmful("useful")


def test_slight_harm_that_repeats_is_kept_out_within_a_few_rounds():
    records = PeerRecords()
    rounds_to_exclusion = None
    for round_no in range(1, 8):
        records = records.observe("slight", round_no, differences(1.4, seed=round_no))
        if records.harmful("slight"):
            rounds_to_exclusion = round_no
            break
    assert rounds_to_exclusion == 2


def test_good_behaviour_cannot_be_banked_to_cover_an_attack():
    records = PeerRecords()
    for round_no in range(1, 20):
        records = records.observe("patient", round_no, differences(-30.0, seed=round_no))
    records = records.observe("patient", 20, differences(30.0, seed=20))
    assert records.harmful("patient")


def test_a_round_measured_again_replaces_its_evidence_rather_than_adding_to_it():
    records = PeerRecords()
    records = records.observe("peer", 1, differences(1.5))
    records = records.observe("peer", 2, differences(1.5))
    once = records.score("peer")
    records = records.observe("peer", 2, differences(1.5))  # the node re-ran round 2's step
    assert records.score("peer") == once


def test_a_record_is_a_value_that_new_evidence_leaves_as_it_was():
    """A step the node runs only to see its outcome (containment, a trial) is undone by
    putting back the records it began with: adding evidence must not change them."""
    before = PeerRecords().observe("peer", 1, differences(-1.0))
    after = before.observe("peer", 2, differences(25.0)).convict("other", 2)
    assert before.score("peer") == pytest.approx(-1.0) and before.score("other") == 0.0
    assert after.harmful("peer") and after.harmful("other")


def test_the_record_survives_its_state_dict():
    records = PeerRecords()
    records = records.observe("helps", 1, differences(-3.0))
    records = records.observe("hurts", 1, differences(3.0))
    records = records.observe("neutral", 1, differences(0.0))
    copy = PeerRecords.from_state_dict(records.state_dict())
    assert copy.state_dict() == records.state_dict()
    scores = [copy.score(peer) for peer in ("helps", "neutral", "hurts")]
    assert scores == pytest.approx([-1.0, 0.0, 3.0])
    assert copy.score("stranger") == 0.0 and not copy.harmful("stranger")


def test_one_round_of_clear_harm_is_measured_again_and_harm_that_repeats_is_not():
    """In a mesh's first round every model trained apart hurts the node it is mixed
    into; only harm that repeats saves the download."""
    records = PeerRecords().observe("peer", 1, differences(25.0))
    assert records.score("peer") > PASS_OVER_BOUND and not records.not_worth_fetching("peer")
    records = records.observe("peer", 2, differences(-25.0))
    assert records.score("peer") < PASS_OVER_BOUND, "it helped the next round"
    records = records.observe("attacker", 1, differences(25.0))
    records = records.observe("attacker", 2, differences(25.0))
    assert records.not_worth_fetching("attacker")


def test_a_peer_passed_over_fades_back_below_the_bound_to_be_measured_again():
    records = PeerRecords()
    for round_no in (1, 2):
        records = records.observe("attacker", round_no, differences(25.0))
    rounds = 2
    while records.not_worth_fetching("attacker"):  # as screening's `wanted` asks
        rounds += 1
        records = records.pass_over("attacker", rounds)
    assert rounds == 3, "passed over one round, then fetched and measured again"
    assert records.score("attacker") >= HARM_BOUND, "its faded record still at the bound"
    records = records.observe("attacker", rounds + 1, differences(25.0))
    assert records.not_worth_fetching("attacker"), "and back out the round after"
