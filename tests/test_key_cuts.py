"""Which hand-written attentions may leave masked keys out: the structural proof, on exported graphs.

A softmax may drop a key only where the model's mask gives it zero probability and nothing else reads the
key's column: these cases keep every key (the planner then gathers them all), with the reason explain shows.
"""

import pytest
import torch

from cp_passes.graph.analysis import sequence_symbol
from cp_passes.match.blocks import match_blocks
from cp_passes.match.key_cuts import key_cuts
from cp_passes.transports.keys import check_hidden

NEG = torch.finfo(torch.float32).min


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
    check_hidden([~causal], ("true",), ((0, 1),), None)  # hides exactly the later keys
    check_hidden([~(causal & ~causal.tril(-3))], ("true",), ((0, 1),), 2)  # a window of 3
    with pytest.raises(RuntimeError, match="outside the window of 3"):
        check_hidden([~causal], ("true",), ((0, 1),), 2)
    additive = torch.zeros(6, 6).masked_fill(~causal, NEG)
    additive[2] = NEG  # query 2 sees nothing: uniform over every key on one device
    with pytest.raises(RuntimeError, match="hides every key from some query"):
        check_hidden([additive], ("additive",), ((0, 1),), None)
