"""Ordinary training code runs under CP and matches one device (issue 53's list): attention written with einsum,
the GPT-2 / nanoGPT / transformers 4.x loss over trimmed rows, means over the sequence (a z-loss, a masked mean, a
router's load-balancing loss with F.one_hot), ``arange(1, S + 1)`` and the older rotary cache check. Parity on
real processes (:mod:`common_code`'s task); what stays refused, and why, on the fake process group."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cp_passes
import common_code
from cp_passes import CPCompileError

DEFAULT = ["Everyday", "WrittenOut", "RelativeTableEager", "DataDependentBias", "StrictlyEarlierKeys"]
"""The default run: one model with one of each kind (the rotary cache check runs in its own test), one with
SDPA written out (an ALiBi bias, memory keys), a learned relative-position bias and one that reads an activation
at the query and the key (its gradient was lost, 0.54 off, while the bias was taken for a learned one), and a
causal mask that is no band (it was refused; now read at the rank's rows); every model on its own under -m full."""


@pytest.mark.parametrize("P,seq_len,layout,names", [
    pytest.param(2, 32, None, DEFAULT, id="P2"),
    pytest.param(2, 32, None, list(common_code.MODELS), marks=pytest.mark.full, id="P2-every-model"),
    pytest.param(4, 64, None, list(common_code.MODELS), marks=pytest.mark.full, id="P4-every-model"),
    pytest.param(2, 32, "contiguous", list(common_code.MODELS), marks=pytest.mark.full, id="P2-contiguous"),
])
def test_common_code_matches_one_device(pool, P, seq_len, layout, names):
    """The ranks' losses add up to one device's and so do their gradients (each rank's loss is its share)."""
    for rank, found in enumerate(pool.run(common_code.parity, P, names=names, seq_len=seq_len, layout=layout)):
        for name, (loss, grads) in found.items():
            assert loss < 1e-5 and grads < 1e-5, (rank, name, loss, grads)


@pytest.mark.parametrize("P,seq_len,layout,names", [
    pytest.param(2, 32, None, ["Pooled"], id="P2"),
    pytest.param(2, 32, None, list(common_code.POOLED), marks=pytest.mark.full, id="P2-every-model"),
    pytest.param(4, 64, None, list(common_code.POOLED), marks=pytest.mark.full, id="P4-every-model"),
    pytest.param(2, 36, "contiguous", list(common_code.POOLED), marks=pytest.mark.full, id="P2-contiguous"),
])
def test_pooled_rows_match_one_device(pool, P, seq_len, layout, names):
    """``h[:, -1]``, ``h[:, 0]``, the argmax pick, ``gather`` and ``index_select`` by a whole index: every rank's
    whole loss is one device's, and the ranks' gradients add up to one device's (a whole output passes back
    1 / P of its gradient on each rank); added to a per-token loss, the pooled loss enters as its 1 / P."""
    for rank, found in enumerate(pool.run(common_code.pooled_parity, P, names=names, seq_len=seq_len,
                                          layout=layout)):
        for name, (loss, grads) in found.items():
            assert loss < 1e-5 and grads < 1e-5, (rank, name, loss, grads)


@pytest.mark.parametrize("P,seq_len,padded_rows", [
    pytest.param(2, 32, 5, id="P2"),
    pytest.param(4, 64, 20, marks=pytest.mark.full, id="P4-padding-on-three-ranks"),
])
def test_transformers_sequence_classification_matches_one_device(pool, P, seq_len, padded_rows):
    """LlamaForSequenceClassification as shipped, a row ending in pad tokens: every rank's loss and logits are one
    device's, and the summed gradients match."""
    for rank, (loss, logits, grads) in enumerate(pool.run(common_code.sequence_classification, P, seq_len=seq_len,
                                                          padded_rows=padded_rows)):
        assert loss < 1e-5 and logits < 1e-5 and grads < 1e-5, (rank, loss, logits, grads)


@pytest.mark.parametrize("name,op,why", [
    ("LastToken", "aten.select.int", "a row counted from the end of the sequence"),
    ("LastNonPadding", "aten.argmax.default", "the position of the max over the sequence"),
])
def test_a_pick_from_the_end_on_a_padded_batch_is_refused(group, name, op, why):
    """shard_batch's padding moves the global end and can hold the max: refused, naming the op."""
    compiled = cp_passes.cp_compile(common_code.POOLED[name](), mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError, match="shard_batch padded the sequence") as info:
        compiled(**cp_passes.shard_batch(common_code.batch(30), group)[0])
    assert f"{op} at" in str(info.value) and why in str(info.value), str(info.value)


class Picks(nn.Module):
    """Reads of sequence rows the adversarial round made silently wrong, each now refused."""

    def __init__(self, read):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.read = nn.Embedding(32, 8), read

    def forward(self, input_ids):
        return self.read(self.emb(input_ids).clone()).pow(2).sum()


def _write_row(h):
    h[:, 0] = 0.0
    return h


def _add_to_last(h):
    h[:, -1] += 1.5
    return h


@pytest.mark.parametrize("read,seq_len,match", [
    (lambda h: h[:, h.shape[1] // 2], 32, r"holds while Eq\(\(s\d+//2\), \d+\)"),
    (_write_row, 32, "aten.fill_.Tensor writes in place into rows of the sequence this op reads"),
    (_add_to_last, 32, "aten.add_.Tensor writes in place into rows of the sequence this op reads"),
    (lambda h: h[:, torch.tensor([-1, -2])], 30, "rows picked by an index tensor: a negative index counts from the "
                                                  "padded end"),
], ids=["row-at-half-the-length", "row-written-in-place", "row-added-to-in-place", "negative-index-padded"])
def test_picks_that_cannot_be_proven_are_refused(group, read, seq_len, match):
    """A row at ``S // 2`` (the op pins the index to this length's value), an in-place write into a picked row
    (each rank holds only its own rows), an index tensor on a padded batch (a negative index counts from the
    padded end): refused, not wrong."""
    compiled = cp_passes.cp_compile(Picks(read), mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError, match=match):
        compiled(**cp_passes.shard_batch({"input_ids": torch.randint(1, 32, (2, seq_len))}, group)[0])


def test_the_rotary_cache_check_holds_until_the_global_length_passes_the_cache(pool):
    """``if seq_len > self.max_seq_len_cached`` with 40 cached rows: 32 and 36 positions (16 and 18 a rank) run
    on one graph; at 64 (32 a rank, under the cache locally, past it on one device) the guard on the global
    length fails, and the new graph is refused naming the line; 40 runs again on the first graph."""
    for outcomes in pool.run(common_code.rotary_lengths, 2, lengths=[32, 36, 64, 40], max_len=40):
        assert outcomes[:2] == ["ran (1 graphs)"] * 2 and outcomes[3] == "ran (1 graphs)", outcomes
        assert outcomes[2].startswith("CPCompileError: the code at if seq_len > self.max_seq_len_cached:"), outcomes
        assert "at a local length of 21 the global length 42 decides the other way" in outcomes[2], outcomes


class Loss(nn.Module):
    """``loss(logits, input_ids)`` over a linear head: the ways of writing a loss that stay refused."""

    def __init__(self, loss):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out, self.loss_fn = nn.Embedding(32, 8), nn.Linear(8, 32), loss

    def forward(self, input_ids):
        return self.loss_fn(self.out(self.emb(input_ids)), input_ids)


@pytest.mark.parametrize("loss,op,why", [
    (lambda logits, ids: F.cross_entropy(logits[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1),
                                         reduction="none").sum(),
     "aten.slice.Tensor", "it slices the sequence axis (dim 1)"),
    (lambda logits, ids: F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:]),
     "aten.slice.Tensor", "it slices the sequence axis (dim 1)"),
    (lambda logits, ids: logits[ids != 0].pow(2).mean(), "aten.mean.default", "boolean mask"),
], ids=["trimmed-reduction-none", "trimmed-classes-second", "masked-then-squared"])
def test_what_stays_refused_names_the_op(group, loss, op, why):
    """A trimmed loss whose rows are returned (or whose classes come second), a masked selection read by another
    op before its mean: refused, naming the op, not rewritten."""
    compiled = cp_passes.cp_compile(Loss(loss), mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError) as info:
        compiled(torch.randint(1, 32, (2, 8)))
    assert info.value.problems[0].op == op and why in info.value.problems[0].reason, str(info.value)


def test_one_hot_counting_its_classes_is_refused_with_the_fix(group):
    """F.one_hot without num_classes would count the classes in this rank's rows: dynamo refuses it first."""
    compiled = cp_passes.cp_compile(Loss(lambda logits, ids: F.one_hot(ids).float().sum()), mesh=group,
                                    backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError, match="Explicitly set the `num_classes` param"):
        compiled(torch.randint(1, 32, (2, 8)))


def test_a_trimmed_loss_on_a_padded_batch_is_refused(group):
    """shard_batch pads token ids with pad_token_id, not ignore_index: the shifted target of the last real row
    would read the padding, so a padded batch is refused (the same rows unpadded run)."""
    compiled = cp_passes.cp_compile(common_code.NanoGPTLoss(), mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(common_code.batch(30), group)
    with pytest.raises(CPCompileError, match="a shift that reads 1 row"):
        compiled(**local)

