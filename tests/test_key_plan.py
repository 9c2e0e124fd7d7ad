"""The key side of attention (``cp_passes.key_plan``): one reading of a mask, one plan, whatever the attention's
form. The reading and the decision are pure functions; the last test compiles the same masks written as SDPA
and as hand-written attention and checks that both plan the same keys."""

import pytest
import torch
import torch.nn.functional as F

import cp_passes
from cp_passes.key_plan import (CAUSAL_REACH, EVERY_KEY_REACH, KeyPlan, Move, Reach, band,
                                mask_reach, outside, read_reach)
from cp_passes.transports.base import TRANSPORTS


def _documents(n: int, lengths: list[int]) -> torch.Tensor:
    """Causal attention within each document of ``lengths`` (summing to ``n``)."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return (doc[:, None] == doc[None, :]) & band(n, None)


@pytest.mark.parametrize("allowed,reach", [
    (band(12, None), CAUSAL_REACH),
    (band(12, 4), Reach(3, 0)),
    (band(12, 3, ahead=2), Reach(2, 2)),
    (torch.ones(12, 12, dtype=torch.bool), EVERY_KEY_REACH),
    (band(12, 12), CAUSAL_REACH),  # a window as long as the sequence is no window
    (band(12, None, ahead=4), Reach(None, 4)),
])
def test_a_band_reads_as_its_reach_and_back(allowed, reach):
    assert mask_reach(allowed) == reach
    assert torch.equal(reach.band(12), allowed)


def test_a_mask_that_is_no_band_has_no_exact_reach_but_an_envelope():
    docs = _documents(12, [5, 4, 3])
    assert isinstance(mask_reach(docs), str)
    assert mask_reach(docs, exact=False) == Reach(4, 0)  # the longest document's causal band holds it
    earlier_only = band(12, None) & ~torch.eye(12, dtype=torch.bool)
    assert mask_reach(earlier_only, exact=False) == CAUSAL_REACH
    assert isinstance(mask_reach(torch.zeros(12, 12, dtype=torch.bool)), str)


def test_a_reach_is_read_at_two_lengths_and_must_agree():
    def fixed(n):
        return mask_reach(band(n, 40))

    def growing(n):  # a window that is a third of the sequence: no fixed window
        return mask_reach(band(n, n // 3))

    assert read_reach(fixed, 100) == Reach(39, 0)
    assert read_reach(fixed, 60) == Reach(39, 0)  # causal at 31 positions: the longer reading, seen in fewer
    found = read_reach(growing, 100)
    assert isinstance(found, str) and "change with the sequence length" in found
    assert read_reach(lambda n: "unreadable", 100) == "unreadable"


@pytest.mark.parametrize("reach,halo,move,first_keys", [
    (Reach(5, 0), True, Move.HALO, False),
    (Reach(5, 0), False, Move.PREFIX, False),  # a window by gather keeps its reach: its halo is the bytes' bound
    (Reach(2, 3), True, Move.HALO, False),
    (Reach(2, 3), False, Move.EVERY_KEY, False),
    (CAUSAL_REACH, True, Move.PREFIX, True),
    (EVERY_KEY_REACH, True, Move.EVERY_KEY, False),
    (Reach(None, 4), True, Move.EVERY_KEY, False),
])
def test_a_plan_moves_a_band_by_halo_the_causal_prefix_by_gather_and_anything_else_whole(reach, halo, move,
                                                                                         first_keys):
    plan = KeyPlan.decide(reach, halo, first_keys=True)
    assert (plan.move, plan.first_keys) == (move, first_keys)
    assert plan.reach == (EVERY_KEY_REACH if move == Move.EVERY_KEY else reach)
    assert plan.halo == (reach.before if move == Move.HALO else None)
    assert plan.message() == outside(plan.reach.before, plan.reach.after or 0)


def test_a_plan_refuses_a_move_its_reach_cannot_take():
    for reach, move in ((CAUSAL_REACH, Move.HALO), (Reach(2, 3), Move.PREFIX), (Reach(3, 0), Move.EVERY_KEY)):
        with pytest.raises(ValueError):
            KeyPlan(reach, move)
    with pytest.raises(ValueError):  # a window's mask is cut to the whole prefix
        KeyPlan(Reach(3, 0), Move.PREFIX, first_keys=True)


def _allowed(n: int, form: str) -> torch.Tensor:
    pos = torch.arange(n)
    distance = pos[:, None] - pos[None, :]
    if form == "causal":
        return distance >= 0
    if form == "window":
        return (distance >= 0) & (distance < 6)
    return (distance <= 3) & (distance >= -2)  # two-sided: 3 keys before, 2 after


class _Attention(torch.nn.Module):
    def __init__(self, form: str, sdpa: bool):
        super().__init__()
        self.embed, self.form, self.sdpa = torch.nn.Embedding(32, 8), form, sdpa

    def forward(self, input_ids):
        x = self.embed(input_ids)
        q = x.view(*x.shape[:2], 2, 4).transpose(1, 2)
        allowed = _allowed(x.shape[1], self.form)
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, q, q, attn_mask=allowed)
        else:
            scores = (q @ q.transpose(-2, -1)) * 0.5
            out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ q
        return out.pow(2).sum()


def _plans(fake_group, monkeypatch, model, spec) -> list[KeyPlan]:
    """The key plans the transports receive while compiling ``model``."""
    seen = []
    for transport in TRANSPORTS.values():
        original = transport.apply

        def apply(edit, request, original=original):
            plan = getattr(request, "plan", None)  # SDPA's K and V
            keys = getattr(request, "brought", None)  # an operand or mask of attention written by hand
            if plan is not None or keys is not None:
                seen.append(plan if plan is not None else keys.plan)
            return original(edit, request)

        monkeypatch.setattr(transport, "apply", apply)
    compiled = cp_passes.cp_compile(model, mesh=fake_group, spec=spec, backend="aot_eager", verbose=False)
    compiled(input_ids=torch.randint(0, 32, (2, 16)))
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("form,transport,plan", [
    ("causal", "halo", KeyPlan(CAUSAL_REACH, Move.PREFIX)),
    ("window", "halo", KeyPlan(Reach(5, 0), Move.HALO)),
    ("window", "gather", KeyPlan(Reach(5, 0), Move.PREFIX)),
    ("two_sided", "halo", KeyPlan(Reach(3, 2), Move.HALO)),
])
def test_sdpa_and_attention_written_by_hand_plan_the_same_keys(fake_group, monkeypatch, form, transport, plan):
    spec = cp_passes.CPSpec(window_transport=transport)
    sdpa = _plans(fake_group, monkeypatch, _Attention(form, sdpa=True), spec)
    by_hand = _plans(fake_group, monkeypatch, _Attention(form, sdpa=False), spec)
    assert sdpa == [plan] and set(by_hand) == {plan}, (sdpa, by_hand)
