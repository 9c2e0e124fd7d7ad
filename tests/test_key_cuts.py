"""Which hand-written attentions may leave masked keys out: the structural proof, on exported graphs.

A softmax may drop a key only where the model's mask gives it zero probability and nothing else reads the
key's column: these cases keep every key (the planner then gathers them all), with the reason explain shows.
"""

import pytest
import torch

import cp_passes
from cp_passes.graph.analysis import sequence_symbol
from cp_passes.match.blocks import match_blocks
from cp_passes.match.key_cuts import key_cuts
from cp_passes.transports.keys import check_hidden
from cp_passes.transports.mask_program import hidden_together

NEG = torch.finfo(torch.float32).min
POS = torch.finfo(torch.float32).max
TRUE, ADDITIVE = ("true", float("-inf"), torch.float32), ("additive", None, torch.float32)


def _causal(x):
    pos = torch.arange(x.shape[1])
    return torch.zeros(x.shape[1], x.shape[1]).masked_fill(pos[None, :] > pos[:, None], NEG)


def masked(x):
    return ((x @ x.transpose(1, 2)).tanh() * 5 + _causal(x)).softmax(-1) @ x


def masked_fill(x):
    pos = torch.arange(x.shape[1])
    return (x @ x.transpose(1, 2)).masked_fill(pos[None, :] > pos[:, None], float("-inf")).softmax(-1) @ x


def sinks(x):
    scores = x @ x.transpose(1, 2) + _causal(x)
    sink = x[..., :1]
    return torch.cat([scores, sink], -1).softmax(-1)[..., :-1] @ x


def max_subtracted(x):  # DeepSeek V4's overflow guard, after the sinks
    logits = torch.cat([x @ x.transpose(1, 2) + _causal(x), x[..., :1]], -1)
    return (logits - logits.max(dim=-1, keepdim=True).values).softmax(-1)[..., :-1] @ x


def amax_subtracted(x):
    logits = x @ x.transpose(1, 2) + _causal(x)
    return (logits - logits.amax(-1, keepdim=True).detach()).softmax(-1) @ x


def max_over_queries_subtracted(x):
    logits = x @ x.transpose(1, 2) + _causal(x)
    return (logits - logits.amax(-2, keepdim=True)).softmax(-1) @ x


def max_indices_read(x):  # the indices count the keys a cut brings, not the sequence's positions
    logits = x @ x.transpose(1, 2) + _causal(x)
    values, indices = logits.max(dim=-1, keepdim=True)
    return (logits - values).softmax(-1) @ x + indices


def global_max_subtracted(x):  # amax over every dim: no key axis to keep
    logits = x @ x.transpose(1, 2) + _causal(x)
    return (logits - logits.amax()).softmax(-1) @ x


def mean_subtracted(x):  # also a constant per row, but the hidden keys' finfo.min drags the mean down
    logits = x @ x.transpose(1, 2) + _causal(x)
    return (logits - logits.mean(-1, keepdim=True)).softmax(-1) @ x


def unmasked_max_subtracted(x):
    scores = x @ x.transpose(1, 2)
    return (scores + _causal(x) - scores.amax(-1, keepdim=True)).softmax(-1) @ x


def no_mask(x):
    return (x @ x.transpose(1, 2)).softmax(-1) @ x


def capped_after_the_mask(x):
    return ((x @ x.transpose(1, 2) + _causal(x)).tanh() * 5).softmax(-1) @ x


def probabilities_read_whole(x):
    probs = (x @ x.transpose(1, 2) + _causal(x)).softmax(-1)
    return probs @ x + probs.sum(-1, keepdim=True)


def scores_read_whole(x):
    scores = x @ x.transpose(1, 2) + _causal(x)
    return scores.softmax(-1) @ x + scores.amax(-1, keepdim=True)


def too_mild_a_mask(x):
    pos = torch.arange(x.shape[1])
    return (x @ x.transpose(1, 2)).masked_fill(pos[None, :] > pos[:, None], -30.0).softmax(-1) @ x


def subtracted_mask(x):
    return torch.add(x @ x.transpose(1, 2), _causal(x), alpha=-1).softmax(-1) @ x


def slices_keys(x):
    probs = (x @ x.transpose(1, 2) + _causal(x)).softmax(-1)
    return probs[..., 1:] @ x[:, 1:]


def _cuts(fn):
    class Wrap(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    x = torch.randn(2, 8, 4)
    exported = torch.export.export(Wrap(), (x,), dynamic_shapes=({1: torch.export.Dim("seq", min=4)},), strict=False)
    gm = exported.module()
    (sym,) = sequence_symbol(list(gm.graph.find_nodes(op="placeholder")))
    cuts = key_cuts(match_blocks(gm, sym))
    return {id(c): c for c in cuts.values()}.values()


@pytest.mark.parametrize("fn,hides", [(masked, "additive"), (masked_fill, "true"), (sinks, "additive"),
                                      (max_subtracted, "additive"), (amax_subtracted, "additive")])
def test_a_masked_softmax_may_leave_hidden_keys_out(fn, hides):
    (cut,) = _cuts(fn)
    assert cut.why is None
    assert [m.hides for m in cut.masking] == [hides]
    assert sum(n.target is torch.ops.aten.matmul.default for n in cut.nodes) == 2  # the scores and probs @ v


@pytest.mark.parametrize("fn,why", [
    (no_mask, "no mask the model applies right before its softmax"),
    (capped_after_the_mask, "no mask the model applies right before its softmax"),
    (too_mild_a_mask, "no mask the model applies right before its softmax"),
    (subtracted_mask, "no mask the model applies right before its softmax"),
    (probabilities_read_whole, "reads the probabilities with something else"),
    (scores_read_whole, "is also read by"),
    (max_over_queries_subtracted, "no mask the model applies right before its softmax"),
    (mean_subtracted, "no mask the model applies right before its softmax"),
    (max_indices_read, "no mask the model applies right before its softmax"),
    (global_max_subtracted, "no mask the model applies right before its softmax"),
    (unmasked_max_subtracted, "no mask the model applies right before its softmax"),
    (slices_keys, "by more than its sink columns"),
])
def test_every_key_stays_where_a_hidden_key_could_still_count(fn, why):
    (cut,) = _cuts(fn)
    assert cut.why is not None and why in cut.why, cut.why


def test_the_run_time_check_fails_on_a_visible_key_left_out_and_on_a_row_that_hides_every_key():
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    check_hidden([~causal], (TRUE,), ((0, 1),), None)  # hides exactly the later keys
    check_hidden([~(causal & ~causal.tril(-3))], (TRUE,), ((0, 1),), 2)  # a window of 3
    with pytest.raises(RuntimeError, match="outside the window of 3"):
        check_hidden([~causal], (TRUE,), ((0, 1),), 2)
    two_sided = (torch.arange(6)[:, None] - torch.arange(6)[None, :]).abs() >= 3  # hidden
    check_hidden([two_sided], (TRUE,), ((0, 1),), 2, after=2)  # an encoder's band: 2 keys on either side
    with pytest.raises(RuntimeError, match="outside the window of 2 keys before and 1 after"):
        check_hidden([two_sided], (TRUE,), ((0, 1),), 2, after=1)
    additive = torch.zeros(6, 6).masked_fill(~causal, NEG)
    additive[2] = NEG  # query 2 sees nothing: uniform over every key on one device
    with pytest.raises(RuntimeError, match="hides every key from some query"):
        check_hidden([additive], (ADDITIVE,), ((0, 1),), None)


def test_masks_hide_what_they_hide_together_in_the_order_the_model_applies_them():
    """``scores + causal + unmask``: ``finfo.max`` added on the prompt's later keys lifts their ``finfo.min``
    back to 0 (each mask on its own hides them, or hides nothing). The run-time check replays the masks in
    order and fails; a union of what each hides passed, and the cut dropped keys one device attends to."""
    later = torch.ones(6, 6, dtype=torch.bool).triu(1)
    causal = torch.zeros(6, 6).masked_fill(later, NEG)
    prompt = torch.zeros(6, 6)
    prompt[:3, :3] = POS
    steps = (ADDITIVE, ADDITIVE)  # the mask applied last first
    assert torch.equal(hidden_together([prompt, causal], steps, ((0, 1), (0, 1))), later & (prompt == 0))
    with pytest.raises(RuntimeError, match="outside the causal prefix"):
        check_hidden([prompt, causal], steps, ((0, 1), (0, 1)), None)
    # a masked_fill with -inf stays -inf under finfo.max, one with finfo.min does not
    check_hidden([prompt, later], (ADDITIVE, TRUE), ((0, 1), (0, 1)), None)
    with pytest.raises(RuntimeError, match="outside the causal prefix"):
        check_hidden([prompt, later], (ADDITIVE, ("true", NEG, torch.float32)), ((0, 1), (0, 1)), None)
    # a position bias added after the mask (ALiBi, positive above the diagonal) leaves it hidden; a per-head
    # bias [H, S, S] lines up with a shared [S, S] mask from the right
    distance = torch.arange(6)[None, :] - torch.arange(6)[:, None]
    alibi = torch.tensor([0.5, 0.25])[:, None, None] * distance
    assert torch.equal(hidden_together([alibi, later], (ADDITIVE, TRUE), ((1, 2), (0, 1))), later.expand(2, 6, 6))



def _later_and_prompt(x):
    pos = torch.arange(x.shape[1])
    return pos[None, :] > pos[:, None], (pos[:, None] < 10) & (pos[None, :] < 10)


def _additive(where):
    return torch.zeros(where.shape).masked_fill(where, NEG)


def unmasked_by_addition(x):  # a prefix LM written as causal plus an un-mask: the later keys' scores sum to 0
    later, prompt = _later_and_prompt(x)
    return (x @ x.transpose(1, 2) + _additive(later) + torch.zeros(later.shape).masked_fill(prompt & later, POS)
            ).softmax(-1) @ x


def _lift(scores, prompt):
    return scores + torch.where(prompt, POS, 0.0)


def unmasked_in_a_helper_after_a_fill(x):
    later, prompt = _later_and_prompt(x)
    return _lift((x @ x.transpose(1, 2)).masked_fill(later, NEG), prompt).softmax(-1) @ x


def lifted_from_minus_infinity(x):  # -inf + finfo.max stays -inf: still causal
    later, prompt = _later_and_prompt(x)
    return _lift((x @ x.transpose(1, 2)).masked_fill(later, float("-inf")), prompt).softmax(-1) @ x


def position_bias_after_the_mask(x):  # ALiBi's bias, positive above the diagonal, added last: still causal
    later, _ = _later_and_prompt(x)
    pos = torch.arange(x.shape[1])
    return (x @ x.transpose(1, 2) + _additive(later) + (pos[None, :] - pos[:, None]) * 0.5).softmax(-1) @ x


def scaled_after_the_mask(x):
    later, _ = _later_and_prompt(x)
    return ((x @ x.transpose(1, 2) + _additive(later)) * 2.0).softmax(-1) @ x


def clamped_after_the_mask(x):
    later, _ = _later_and_prompt(x)
    return (x @ x.transpose(1, 2) + _additive(later)).clamp(min=-1.0).softmax(-1) @ x


def unmasked_by_where(x):
    later, prompt = _later_and_prompt(x)
    scores = x @ x.transpose(1, 2)
    return torch.where(prompt, scores, scores + _additive(later)).softmax(-1) @ x


def refilled_with_zero(x):
    later, prompt = _later_and_prompt(x)
    return (x @ x.transpose(1, 2) + _additive(later)).masked_fill(prompt & later, 0.0).softmax(-1) @ x


class _Attend(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.embed, self.fn = torch.nn.Embedding(32, 8), fn

    def forward(self, input_ids):
        return self.fn(self.embed(input_ids)).pow(2).sum()


@pytest.mark.parametrize("fn,keys", [
    (unmasked_by_addition, "every key (its masks let a query see later keys"),
    (unmasked_in_a_helper_after_a_fill, "every key (its masks let a query see later keys"),
    (lifted_from_minus_infinity, "the causal prefix"),
    (position_bias_after_the_mask, "the causal prefix"),
    (scaled_after_the_mask, "every key ("),
    (clamped_after_the_mask, "every key ("),
    (unmasked_by_where, "every key ("),
    (refilled_with_zero, "every key ("),
])
def test_keys_come_as_the_scores_after_every_mask_show(group, fn, keys):
    """What a later addition, product, clamp or ``where`` does to a hidden score decides the keys: an un-mask
    by ``finfo.max`` (in a helper too) lifts ``finfo.min`` back, so every key comes (the cut dropped the
    prompt's later keys once); ``-inf`` stays hidden, and so does ``finfo.min`` under a position bias."""
    compiled = cp_passes.cp_compile(_Attend(fn), mesh=group, backend="aot_eager", verbose=False)
    compiled(input_ids=torch.randint(0, 32, (2, 16)))
    notes = [r.note for r in compiled.compile_records[0].records if r.rule == "key_operand"]
    assert len(notes) == 2 and all(keys in note for note in notes), notes


def _heads(x, heads=2):
    b, s, d = x.shape
    return x.view(b, s, heads, d // heads).transpose(1, 2)


def _slopes(x):
    return torch.tensor([0.5, 0.25], dtype=x.dtype)


def alibi_per_head(x):  # [H, S, S] bias, then a causal masked_fill
    q, pos = _heads(x), torch.arange(x.shape[1])
    bias = _slopes(x)[:, None, None] * (pos[None, None, :] - pos[None, :, None])
    scores = (q @ q.transpose(-2, -1) + bias).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    return (scores.softmax(-1) @ q).sum(1)


def alibi_shared_where(x):  # [S, S] bias inside a where
    pos = torch.arange(x.shape[1])
    bias = -(pos[:, None] - pos[None, :]).abs() * 0.5
    return torch.where(pos[None, :] <= pos[:, None], x @ x.transpose(1, 2) + bias, float("-inf")).softmax(-1) @ x


def _bloom(x, key_size):
    """Bloom's attention: ``alibi.baddbmm(q, k^T)`` over ``[batch * heads, S, S]``, viewed as ``[batch, heads, S,
    S]`` for the mask and back for ``bmm`` with V."""
    b, s, d = x.shape
    q = _heads(x).reshape(b * 2, s, d // 2)
    pos = torch.arange(s)
    alibi = (_slopes(x).repeat(b)[:, None] * pos[None, :])[:, None, :]
    scores = alibi.baddbmm(q, q.transpose(1, 2), beta=1.0, alpha=0.5).view(b, 2, s, key_size(s))
    scores = scores.masked_fill(pos[None, :] > pos[:, None], torch.finfo(x.dtype).min)
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
    return torch.bmm(probs.view(b * 2, s, key_size(s)), q).view(b, 2, s, d // 2).sum(1)


def bloom_sized_minus_one(x):  # as transformers writes it
    return _bloom(x, lambda s: -1)


def bloom_sized_by_the_length(x):
    return _bloom(x, lambda s: s)


@pytest.mark.parametrize("fn", [alibi_per_head, alibi_shared_where, bloom_sized_minus_one, bloom_sized_by_the_length])
def test_alibi_brings_the_causal_prefix_of_its_keys(group, fn):
    """ALiBi adds a bias along the key axis (per head, shared, or Bloom's ``baddbmm``) and stays causal: the
    bias is evaluated as a mask or brought with the keys, and the causal cut holds. A per-head bias beside a
    causal mask failed inside the rewrite; Bloom's ``baddbmm`` was refused as a softmax along the sequence."""
    compiled = cp_passes.cp_compile(_Attend(fn), mesh=group, backend="aot_eager", verbose=False)
    compiled(input_ids=torch.randint(0, 32, (2, 16)))
    notes = [r.note for r in compiled.compile_records[0].records if r.rule == "key_operand"]
    assert notes and all("the causal prefix" in note for note in notes), notes


def scores_viewed_across_the_sequence(x):  # [B, S, S] -> [S, B, S]: the query axis is no longer a dim
    b, s, _ = x.shape
    pos = torch.arange(s)
    scores = (x @ x.transpose(1, 2)).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    return (scores.view(s, b, s).softmax(-1).view(b, s, s) @ x)


def test_a_view_that_moves_the_sequence_dims_of_scores_is_refused(group):
    compiled = cp_passes.cp_compile(_Attend(scores_viewed_across_the_sequence), mesh=group, backend="aot_eager",
                                    verbose=False)
    with pytest.raises(cp_passes.CPCompileError, match="cannot tell where aten.view.default puts the key axis"):
        compiled(input_ids=torch.randint(0, 32, (2, 16)))
