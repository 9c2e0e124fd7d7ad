"""Models that mix sequence positions without a rule are refused at compile time, with the op,
the source line and a fix; nothing runs on a wrong answer."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cp_passes
from cp_passes import CPCompileError


class Tiny(nn.Module):
    """A token model whose ``mix`` step is the op under test."""

    def __init__(self, mix):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.proj = nn.Linear(8, 8)
        self.mix = mix

    def forward(self, ids):
        return self.proj(self.mix(self.embed(ids)))


def refusal(group, mix, seq=8) -> CPCompileError:
    compiled = cp_passes.cp_compile(Tiny(mix), mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError) as info:
        compiled(torch.randint(0, 32, (2, seq)))
    return info.value


CASES = {
    "flip": (lambda x: x.flip(1), "aten.flip.default", "x.flip(1)"),
    "roll": (lambda x: torch.roll(x, 1, dims=1), "aten.roll.default", "torch.roll(x, 1, dims=1)"),
    "sort": (lambda x: x.sort(dim=1).values, "aten.sort.default", "x.sort(dim=1)"),
    "pad": (lambda x: F.pad(x, (0, 0, 1, 0)), "aten.pad.default", "F.pad(x, (0, 0, 1, 0))"),
    "shift": (lambda x: x[:, 1:], "aten.slice.Tensor", "x[:, 1:]"),
    "conv": (lambda x: F.conv1d(x.transpose(1, 2), torch.ones(8, 1, 3), groups=8, padding=2).transpose(1, 2),
             "aten.conv", "F.conv1d"),
    "softmax_over_seq": (lambda x: x.softmax(dim=1), "aten.softmax.int", "x.softmax(dim=1)"),
    "gram_over_seq": (lambda x: x + (x.transpose(1, 2) @ x).sum(1, keepdim=True), "aten.matmul.default",
                      "x.transpose(1, 2) @ x"),
    "scores_softmax_over_queries": (lambda x: (x @ x.transpose(1, 2)).softmax(1) @ x, "aten.softmax.int",
                                    "softmax(1)"),
    # the mean is this rank's share of it; read with this rank's rows, the share is refused where it is read
    "mean_over_seq": (lambda x: x - x.mean(1, keepdim=True), "aten.sub.Tensor", "x.mean(1, keepdim=True)"),
    "length_as_value": (lambda x: x * x.shape[1], "aten.mul.Tensor", "x * x.shape[1]"),
    "model_built_band_not_a_mask": (
        lambda x: torch.ones(x.shape[1], x.shape[1]).tril() @ x,
        "aten.tril.default", "tril"),
    "last_token": (lambda x: x[:, -1:].expand_as(x), "aten.slice.Tensor", "x[:, -1:]"),
}


TABLE = torch.randn(64, 8)


def _tokens(x):
    """Token-like indices computed from the sharded activations: [batch, seq], sharded like them."""
    return x.argmax(-1)


def _bag_set_item(x):
    bag = torch.zeros(x.shape[0], 8)
    bag[torch.arange(x.shape[0])[:, None], _tokens(x)] = 1.0
    return x + bag[:, None]


def _counts_in_place(x):
    counts = torch.zeros(8)
    counts.index_put_((_tokens(x).flatten(),), torch.ones(x.shape[0] * x.shape[1]), accumulate=True)
    return x * counts


# Writes from sharded positions into a tensor without the sequence axis: each rank writes its own only.
CASES.update({
    "bag_index_put": (lambda x: x + torch.zeros(x.shape[0], 8).index_put(
        (torch.arange(x.shape[0])[:, None], _tokens(x)), torch.tensor(1.0))[:, None], "aten.index_put.default",
        "index_put("),
    "counts_index_put_accumulate": (lambda x: x * torch.zeros(8).index_put(
        (_tokens(x).flatten(),), x.sum(-1).flatten(), accumulate=True), "aten.index_put.default", "index_put("),
    "bag_set_item": (_bag_set_item, "aten.index_put_.default", "bag[torch.arange"),
    "counts_index_put_in_place": (_counts_in_place, "aten.index_put_.default", "counts.index_put_("),
})
# The local length used as a row, a length or an offset into a tensor that is not sharded.
CASES.update({
    "narrow_table_to_length": (lambda x: x + TABLE.narrow(0, 0, x.shape[1]), "aten.narrow.default",
                               "TABLE.narrow(0, 0, x.shape[1])"),
    "split_table_at_length": (lambda x: x + TABLE.split([x.shape[1], 64 - x.shape[1]])[0],
                              "aten.split_with_sizes.default", "TABLE.split("),
    "table_row_by_length": (lambda x: x + TABLE[x.shape[1] // 4], "aten.select.int", "TABLE[x.shape[1] // 4]"),
    "narrow_table_at_length": (lambda x: x + TABLE.narrow(0, x.shape[1] // 4, 1), "aten.narrow.default",
                               "TABLE.narrow(0, x.shape[1] // 4, 1)"),
    "length_as_a_flag": (lambda x: torch.where(torch.tensor(x.shape[1] > 20), x * 2, x),
                         "aten.scalar_tensor.default", "torch.tensor(x.shape[1] > 20)"),
    "roll_by_length": (lambda x: x + TABLE[:8].roll(x.shape[1], 0)[0], "aten.roll.default", "roll(x.shape[1], 0)"),
})


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_with_op_source_and_fix(group, case):
    mix, op, code = CASES[case]
    err = refusal(group, mix)
    first = err.problems[0]
    assert first.op.startswith(op), str(err)
    assert "test_refusals.py" in first.source and code in first.source, first.source
    assert first.module == "", first.module
    assert first.fix and first.reason
    assert op.split(".")[1] in str(err) and "fix:" in str(err)


def test_hand_written_attention_compiles_but_not_contractions_over_the_queries(group):
    """q @ k^T makes the key axis whole (k brought from every rank): softmax over keys and @ v are fine; a
    product that contracts the query axis is not attention, and stays refused."""
    compiled = cp_passes.cp_compile(Tiny(lambda x: (x @ x.transpose(1, 2)).softmax(-1) @ x), mesh=group,
                                    backend="aot_eager", verbose=False)
    compiled(torch.randint(0, 32, (2, 8)))
    assert [r.rule for r in compiled.compile_records[-1].records] == ["key_operand", "key_operand"]
    err = refusal(group, lambda x: (x @ x.transpose(1, 2)).transpose(1, 2) @ x)
    assert [p.op for p in err.problems] == ["aten.matmul.default"]
    assert "contracts over the sequence axis" in err.problems[0].reason


def _merged_attention(x):
    b, s, d = x.shape
    flat = x.reshape(b * s, d)  # batch and sequence merged: the query axis is not one rank's positions
    return ((flat @ flat.transpose(0, 1)).softmax(-1) @ flat).view(b, s, d)


@pytest.mark.parametrize("mix", [lambda x: (x @ x.transpose(1, 2)).movedim(2, 1).softmax(-1).movedim(2, 1) @ x,
                                 _merged_attention], ids=["softmax_over_queries_after_movedim", "merged_axes"])
def test_scores_whose_key_axis_cannot_be_followed_are_refused(group, mix):
    """movedim puts the query axis last (the softmax then runs over queries); a sequence merged with the batch
    is no rank's contiguous positions: neither compiles."""
    err = refusal(group, mix)
    assert err.problems[0].op == "aten.softmax.int" and "sequence axis" in err.problems[0].reason


def test_attention_scores_are_not_returned(group):
    class Scores(nn.Module):
        def forward(self, x):
            return x @ x.transpose(1, 2)

    compiled = cp_passes.cp_compile(Scores(), cp_passes.CPSpec(seq_inputs=("x",)), mesh=group, backend="aot_eager",
                                    verbose=False)
    with pytest.raises(CPCompileError) as info:
        compiled(x=torch.randn(2, 8, 4))
    assert "a [q, k] block" in info.value.problems[0].reason


def test_all_problems_listed_at_once(group):
    err = refusal(group, lambda x: torch.roll(x.flip(1), 1, dims=1))
    assert [p.op for p in err.problems] == ["aten.flip.default", "aten.roll.default"]


def test_a_max_of_floating_values_over_the_sequence_is_refused(group):
    """Integer and boolean extremes are all-reduced (tests/test_parity.py); a floating one has no rule."""
    err = refusal(group, lambda x: x.float().amax(1, keepdim=True) * x)
    assert err.problems[0].op == "aten.amax.default" and "floating values" in err.problems[0].fix


def test_a_partial_sum_read_non_linearly_is_made_global(group):
    """A per-rank sum flows as it is through linear ops only; a square reads the all-reduced global sum."""
    compiled = cp_passes.cp_compile(Tiny(lambda x: (x.sum(1, keepdim=True) ** 2).expand_as(x)), mesh=group,
                                    backend="aot_eager", verbose=False)
    compiled(torch.randint(0, 32, (2, 8)))
    (record,) = [r for r in compiled.compile_records[-1].records if r.rule == "global_sum"]
    assert record.op == "aten.pow.Tensor_Scalar"


@pytest.mark.parametrize("mix", [lambda x: x.cumsum(2), lambda x: x.flip(0), lambda x: x.softmax(-1),
                                 lambda x: x.amax(-1, keepdim=True) * x, lambda x: x.transpose(0, 1).reshape(-1, 8)])
def test_off_axis_ops_are_accepted(group, mix):
    compiled = cp_passes.cp_compile(Tiny(mix), mesh=group, backend="aot_eager", verbose=False)
    compiled(torch.randint(0, 32, (2, 8)))
    assert len(compiled.compile_records) == 1


def test_partial_sum_plus_a_per_rank_value_is_refused(group):
    err = refusal(group, lambda x: x.sum(1, keepdim=True) + x)
    assert err.problems[0].op == "aten.add.Tensor" and "partial sum" in err.problems[0].reason


class Counted(nn.Module):
    """Features scaled by a test on the count of token 3, which ``count`` computes from the sharded ids."""

    def __init__(self, count):
        super().__init__()
        self.count = count

    def forward(self, input_ids, feats):
        return feats * self.count((input_ids == 3).sum())


def _global_sums(count) -> list[tuple[str, list[str]]]:
    """For each op that the plan makes read the global value of the count: (op, the partial sums it reads)."""
    from cp_passes.compiler.planner import plan_graph
    from cp_passes.graph.analysis import sequence_symbol
    from cp_passes.group import CPGroup

    batch = {"input_ids": torch.randint(0, 5, (2, 8)), "feats": torch.randn(3, 4)}
    seq = torch.export.Dim("seq", min=2)
    gm = torch.export.export(Counted(count), (), batch, dynamic_shapes={"input_ids": {1: seq}, "feats": None},
                             strict=False).module()
    (sym,) = sequence_symbol(list(gm.graph.find_nodes(op="placeholder")))
    plan = plan_graph(gm, sym, cp_passes.CPSpec(), CPGroup(None, "t", 3, 8))
    return [(str(node.target), [str(p.target) for p in rw.request.partial])
            for node, rw, _ in plan.rewrites if rw.rule == "global_sum"]


def test_an_integer_count_read_other_than_linearly_is_made_global_at_its_reader():
    assert _global_sums(lambda n: n > 3) == [("aten.gt.Scalar", ["aten.sum.default"])]
    # a square reads the count twice: (sum of counts)^2, not the sum of squares
    assert _global_sums(lambda n: n * n > 3) == [("aten.mul.Tensor", ["aten.sum.default"])]
    # type_as reads only the count's dtype: the 5 it casts stays 5, not P x 5
    assert _global_sums(lambda n: n == torch.tensor(5).type_as(n)) == [
        ("aten.type_as.default", ["aten.sum.default"]), ("aten.eq.Tensor", ["aten.sum.default"])]
    # a floor division is not linear: the ranks' floors do not add up to the floor of the total
    assert _global_sums(lambda n: torch.div(n, 2, rounding_mode="floor") > 0) == [
        ("aten.div.Tensor_mode", ["aten.sum.default"])]


def test_a_float_sum_cast_to_an_integer_is_made_global_before_the_cast():
    """Truncation is not linear: the cast reads the global float sum (all-reduced, with its gradient), and the
    scaling before it stays a per-rank share."""
    assert _global_sums(lambda n: n.float().mul(0.5).long() > 3) == [("aten.to.dtype", ["aten.mul.Tensor"])]


def test_an_eager_module_given_a_sharded_input_is_refused_naming_it(group):
    model = Tiny(nn.Linear(8, 8))
    spec = cp_passes.CPSpec(eager_modules=("mix",))
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError, match="eager module 'mix' takes sequence-sharded inputs"):
        compiled(torch.randint(0, 32, (2, 8)))


def test_hf_label_shift_inside_the_model_is_a_shift_of_one_row(group):
    """transformers pads labels by one ignore_index and slices from 1: each range reads the next range's first
    label (rank 3 of 8, balanced, holds chunks 3 and 12: it receives the first labels of chunks 4 and 13, one
    int64 per batch row each, and sends its own two back)."""
    from family_models import hf_llama

    compiled = cp_passes.cp_compile(hf_llama(), mesh=group, backend="aot_eager", verbose=False)
    ids = torch.randint(0, 128, (2, 8))
    compiled(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(8))
    (row,) = [r for r in compiled.compile_records[0].records if r.transport == "shift"]
    assert row.rule == "shift_stencil" and "loss_utils.py" in row.source and "t+1" in row.note
    assert row.bytes == row.lower_bound_bytes == row.sent_bytes == 2 * 2 * 8


def test_hf_mean_loss_becomes_a_sum_over_the_global_count(group):
    from family_models import hf_llama

    compiled = cp_passes.cp_compile(hf_llama(), mesh=group, backend="aot_eager", verbose=False)
    ids = torch.randint(0, 128, (1, 8))
    compiled(input_ids=ids, labels=ids, shift_labels=ids).loss.backward()
    record = compiled.compile_records[0]
    rules = {r.rule: r for r in record.records}
    assert rules["global_mean"].module == "" and "loss_utils.py" in rules["global_mean"].source
    assert [r.module for r in record.records if r.rule == "sdpa_causal"] == [
        "model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert record.aot_ops["forward"]["cp_passes.global_count.default"] == 1
    assert record.aot_ops["backward"]["cp_passes.global_count.default"] == 0  # the count has no autograd


def test_class_weighted_mean_is_refused(group):
    def mix(x):
        flat = x.flatten(0, 1)
        return F.cross_entropy(flat, flat.argmax(-1), weight=torch.ones(8))[None, None, None].expand(2, 8, 8)

    err = refusal(group, mix)
    assert err.problems[0].op == "aten.cross_entropy_loss.default" and "class weights" in err.problems[0].reason


def test_hf_packed_sequence_mask_is_evaluated_from_gathered_positions(group):
    """Without a cache, transformers 5.x derives a packed-document mask from position_ids with diff,
    cumsum and indexing along the sequence; those ops only build the mask, so the attention rule claims
    them and evaluates the mask over the whole sequence from gathered position ids."""
    from family_models import hf_llama

    compiled = cp_passes.cp_compile(hf_llama(use_cache=False), mesh=group, backend="aot_eager", verbose=False)
    ids = torch.randint(0, 128, (1, 8))
    compiled(input_ids=ids, position_ids=torch.arange(8)[None])
    record = compiled.compile_records[0]
    assert [r.rule for r in record.records if r.rule.startswith("sdpa")] == ["sdpa_data_mask"] * 2
    assert "cumsum" in record.history[1][1] and "cp_mask_fn_" in record.history[-1][1]
    # per layer: one causal prefix of K+V together; the position ids (metadata) both layers gather are the same
    # value, which the partitioner's common-subexpression elimination gathers once
    forward = record.aot_ops["forward"]
    assert forward["cp_passes.prefix_gather.default"] == 2 and forward["cp_passes.metadata_gather.default"] == 1
    assert [r.rule for r in record.records if r.metadata_bytes] == ["sdpa_data_mask"] * 2


def test_a_mask_a_gradient_flows_through_is_refused(group):
    """A float mask computed from activations is a bias the gradient flows back through: it cannot be
    evaluated from gathered values without their autograd edges (a boolean one, or indices, can)."""
    def mix(x):
        q, total = x[:, None], x.sum(-1)
        bias = total[:, None, :, None] - total[:, None, None, :]
        return F.scaled_dot_product_attention(q, q, q, attn_mask=bias)[:, 0]

    err = refusal(group, mix)
    assert "carries a gradient back to what it is computed from" in err.problems[0].reason


def _filled(x):
    both = x.new_empty(*x.shape[:-1], 16)
    both[..., :8].copy_(x)
    both[..., 8:].copy_(x * 2)
    return both[..., :8] * both[..., 8:]


def test_copies_into_slices_of_a_fresh_tensor_are_written_out_of_place(group):
    """MLA's expand_kv builds K by copying into two slices of new_empty(...): the copies become slice_scatter
    before planning (the record keeps the graph after it), and the result is the eager one."""
    torch.manual_seed(0)
    model = Tiny(_filled)
    compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
    ids = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(compiled(ids), model(ids), rtol=0, atol=0)
    history = dict(compiled.compile_records[0].history)
    assert "aten.slice_scatter" in history["fills out of place"] and "aten.copy_" not in history["fills out of place"]


def _filled_whole(x):
    whole = x.new_empty(x.shape)
    whole[..., :8].copy_(x)  # every column: an alias of the whole tensor
    return whole.mul_(2) + x


def test_a_copy_into_the_whole_of_a_fresh_tensor_stays_a_copy(group):
    """Written out of place, the filled tensor must not be the source itself: the in-place doubling after it
    would double x too."""
    torch.manual_seed(0)
    model = Tiny(_filled_whole)
    compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
    ids = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(compiled(ids), model(ids), rtol=0, atol=0)
    assert "aten.alias" in dict(compiled.compile_records[0].history)["aten (pre-dispatch)"]


def test_a_read_between_copies_into_a_fresh_tensor_is_refused(group):
    def mix(x):
        both = x.new_empty(*x.shape[:-1], 16)
        both[..., :8].copy_(x)
        half = both.sum(-1, keepdim=True)  # sees the tensor half filled
        both[..., 8:].copy_(x)
        return both[..., :8] * half

    err = refusal(group, mix)
    assert err.problems[0].op == "aten.copy_.default" and "mutates" in err.problems[0].reason


def test_graph_break_is_an_error_not_a_silent_eager_fallback(group):
    def mix(x):
        torch._dynamo.graph_break()
        return x.cumsum(1)

    err = refusal(group, mix)
    assert "whole forward as one graph" in str(err) and "graph_break" in str(err)


def compile_error(group, model, spec, seq=8) -> CPCompileError:
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError) as info:
        compiled(torch.randint(0, 32, (2, seq)))
    return info.value


def toy(**config):
    from cp_passes.tools.models import ToyLlama, ToyLlamaConfig

    torch.manual_seed(0)
    return ToyLlama(ToyLlamaConfig(**config))


@pytest.mark.parametrize("config,declared,found", [
    (dict(window=5), 4, "a band mask of window 5"),
    (dict(), 4, "is_causal=True (no window)"),
    (dict(window=5), None, "a band mask of window 5"),
    (dict(window=1000), 4, "a band mask of window 1000"),  # causal at these 64 positions, not a window of 4
])
def test_spec_window_that_disagrees_with_the_model_is_refused(group, config, declared, found):
    spec = cp_passes.CPSpec(attention=(cp_passes.AttentionRule("layers.*.attn", window=declared),))
    err = compile_error(group, toy(**config), spec)
    said = f"window {declared}" if declared else "causal attention"
    assert f"the spec declares {said} for modules 'layers.*.attn'" in err.problems[0].reason
    assert found in err.problems[0].reason
    assert err.problems[0].module == "layers.0.attn"


def test_spec_window_that_agrees_compiles(group):
    spec = cp_passes.CPSpec(attention=(cp_passes.AttentionRule("layers.*.attn", window=5),),
                            causal_convs=("layers.*.conv.conv",))
    compiled = cp_passes.cp_compile(toy(window=5, conv_kernel=3), spec, mesh=group, backend="aot_eager",
                                    verbose=False)
    compiled(torch.randint(0, 32, (2, 8)))
    notes = {r.rule: r.note for r in compiled.compile_records[0].records}
    assert "declared by 'layers.*.conv.conv'" in notes["causal_conv_slice"]


class SameConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)

    def forward(self, ids):
        return self.conv(self.embed(ids).transpose(1, 2))


def test_declared_causal_conv_that_is_not_causal_is_refused(group):
    err = compile_error(group, SameConv(), cp_passes.CPSpec(causal_convs=("conv",)))
    assert "the spec declares modules 'conv' causal" in err.problems[0].reason
    assert "kernel 3, dilation 1, padding [1]" in err.problems[0].reason


def test_a_window_wider_than_the_probe_is_read_from_the_mask(group):
    """A band mask of 4,200 keys at 8,200 positions (longer than the mask is evaluated at): read from its
    structure, no declaration needed; a declaration that agrees is accepted too."""
    from cp_passes.key_plan import PROBE_MAX_LEN

    window = PROBE_MAX_LEN + 100
    long_seq = 2 * PROBE_MAX_LEN // 8  # local length at rank 3 of 8: a global length beyond the probe (odd:
    # contiguous shards)
    for spec in (cp_passes.CPSpec(layout="contiguous"),
                 cp_passes.CPSpec(attention=(cp_passes.AttentionRule("layers.*.attn", window=window),),
                                  layout="contiguous")):
        compiled = cp_passes.cp_compile(toy(window=window), spec, mesh=group, backend="aot_eager", verbose=False)
        compiled(torch.randint(0, 32, (1, long_seq)))
        records = compiled.compile_records[0].records
        assert {r.rule for r in records} >= {"sdpa_window"}
        assert any(f"window {window}" in r.note for r in records if r.rule == "sdpa_window") or spec.attention


def test_selective_checkpointing_is_refused_naming_context_fn(group):
    """A selective checkpointing policy picks among post-dispatch ATen ops that only exist after cp_passes
    rewrote the graph: refused, saying how to checkpoint instead."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    policy = partial(create_selective_checkpoint_contexts, lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE)
    err = refusal(group, lambda x: checkpoint(torch.tanh, x, use_reentrant=False, context_fn=policy))
    assert "context_fn" in str(err) and "checkpoint without context_fn" in str(err)


def test_a_cache_that_slices_the_sequence_asks_for_use_cache_false(group):
    """transformers' sliding-window cache keeps the last window - 1 positions: on a shard those would be this
    rank's, so the slice is refused, and the fix says what a training step does."""
    from family_models import hf_batch, hf_gemma2

    model = hf_gemma2()
    compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
    batch = hf_batch(8)
    with pytest.raises(CPCompileError) as info:
        compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True)
    assert {p.source.split(" in ")[0].split(":")[0] for p in info.value.problems} == {"transformers/cache_utils.py"}
    assert all(p.fix.startswith("call the model with use_cache=False") for p in info.value.problems)


def test_checkpointed_layers_with_a_configured_cache_compile(group):
    """With activation checkpointing on, transformers turns a configured cache off and logs it; the log call
    traces as a no-op (it stopped dynamo, and the error asked for use_cache=False), so the step compiles."""
    from family_models import hf_llama

    model = hf_llama()
    model.activation_checkpointing_enable()
    compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch({"input_ids": torch.randint(0, 128, (1, 64))}, group)
    assert compiled(**local).logits.shape == (1, 8, 128)
    assert len(compiled.compile_records) == 1


def _doubled_past(threshold):
    def mix(x):
        if x.shape[1] > threshold:
            return x * 2
        return x
    return mix


def test_a_decision_on_the_local_length_that_the_global_length_takes_otherwise_is_refused(group):
    """At 8 local positions of 8 ranks (64 in all) ``x.shape[1] > 20`` is False here and True on one device."""
    message = str(refusal(group, _doubled_past(20)))
    assert "the code at if x.shape[1] > threshold:" in message and "decides on the sequence length" in message
    assert "test_refusals.py" in message and "Fix: decide on a length passed in as an input" in message, message


def test_a_branch_the_global_length_takes_the_same_way_compiles(group):
    """``x.shape[1] > 4`` holds for the local length 8 and so for every global length 8 * P: not refused."""
    compiled = cp_passes.cp_compile(Tiny(_doubled_past(4)), mesh=group, backend="aot_eager", verbose=False)
    compiled(torch.randint(0, 32, (2, 8)))


def _pad_by(width):
    def shift(x):
        return F.pad(x, (0, 0, width(x.shape[1]), 0))[:, :x.shape[1]]
    return shift


@pytest.mark.parametrize("mix,shown", [
    (_pad_by(lambda s: s // 2), "//2), 0]"),
    (_pad_by(lambda s: s - 3), " - 3, 0]"),
    (lambda x: F.pad(x, (0, 0, 0, x.shape[1] // 4))[:, x.shape[1] // 4:], "//4)]"),
    (lambda x: F.pad(x.transpose(1, 2), (x.shape[1] // 2, 0))[..., :x.shape[1]].transpose(1, 2), "//2), 0]"),
])
def test_a_pad_by_a_width_computed_from_the_length_is_refused_naming_it(group, mix, shown):
    """A pad width computed in the graph (an FX node, not an int) is a shift that depends on the length:
    refused at the pad, not an internal error comparing the node to 0."""
    err = refusal(group, mix)
    first = err.problems[0]
    assert first.op == "aten.pad.default" and "test_refusals.py" in first.source, str(err)
    assert "computed from the sequence length" in first.reason and shown in first.reason, first.reason
    assert "pad by a constant" in first.fix
    assert "cp_passes bug" not in str(err)


def test_an_internal_failure_keeps_its_traceback(group, monkeypatch):
    """A bug inside cp_passes is reported as one, with its innermost frames in the message and the original
    error chained as the cause (dynamo's wrappers dropped, the traceback kept)."""
    import traceback

    import cp_passes.compiler.planner as planner

    matched = planner.match_graph

    def comparing_a_node_to_an_int(gm, sym, multiple=1):
        matched(gm, sym, multiple)
        return next(iter(gm.graph.nodes)) < 0

    monkeypatch.setattr(planner, "match_graph", comparing_a_node_to_an_int)
    err = refusal(group, lambda x: x * 2)
    said = str(err)
    assert "cp_passes failed while rewriting the graph (TypeError)" in said and "cp_passes bug" in said, said
    assert "compiler/planner.py:" in said and "in plan_graph: matches = match_graph(" in said, said
    assert said.index("in plan_graph") < said.index("in comparing_a_node_to_an_int: return next("), said
    assert isinstance(err.__cause__, TypeError) and err.internal is err.__cause__
    chained = "".join(traceback.format_exception(err))
    assert "in comparing_a_node_to_an_int" in chained and "direct cause" in chained, chained


def chunk_scan(x, chunk=4):
    """A chunked scan as linear-attention kernels write it: pad to whole chunks, a state carried across them."""
    length = x.shape[1]
    x = F.pad(x, (0, 0, 0, (chunk - length % chunk) % chunk))
    chunks = x.reshape(x.shape[0], -1, chunk, x.shape[2])
    state = chunks.sum(2).cumsum(1)
    return (chunks + state[:, :, None]).reshape(x.shape[0], -1, x.shape[2])[:, :length]


def test_a_chunked_scan_is_refused_at_its_padding_naming_the_kernel_to_declare(group):
    """Padding up to whole chunks is a width computed from the length (an FX node): the construct is a chunked
    kernel, and the fix names the function to declare as a Recurrence."""
    err = refusal(group, lambda x: chunk_scan(x))
    first = err.problems[0]
    assert first.op == "aten.pad.default" and "in chunk_scan" in first.source, str(err)
    assert "up to a multiple of 4" in first.reason and "chunk_scan (called at" in first.reason, first.reason
    assert ":chunk_scan', sequence_args=(<those of 'x' that carry the sequence>)" in first.fix, first.fix
    assert "cp_passes bug" not in str(err)


class IdsMaskAttention(nn.Module):
    """SDPA under a mask the model computes from its token ids."""

    def __init__(self, mask):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.proj = nn.Linear(8, 8)
        self.mask = mask

    def forward(self, input_ids):
        x = self.embed(input_ids)
        q = x[:, None]
        return self.proj(F.scaled_dot_product_attention(q, q * 0.5, q + 1, attn_mask=self.mask(input_ids))[:, 0])


def _padding_only(ids):
    return (1.0 - (ids != 0)[:, None, None, :].float()) * torch.finfo(torch.float32).min


def _padding_and_causal(ids):
    from shared import additive_mask_from_ids

    return additive_mask_from_ids(ids, torch.float32)


def _padding_times_causal(ids):
    length = ids.shape[1]
    keep = (ids != 0).float()[:, None, None, :] * torch.ones(length, length).tril()
    return (1.0 - keep) * -10000.0


@pytest.mark.parametrize("mask", [_padding_only, _padding_and_causal, _padding_times_causal])
def test_an_additive_mask_from_token_ids_given_to_sdpa_is_refused_naming_the_boolean_form(group, mask):
    """A float mask computed from the token ids (Hugging Face 4.x's padding and causal masks) cannot be
    rebuilt per rank as it is; the refusal names what it reads and the boolean mask that can (which compiles,
    for the causal ones)."""
    compiled = cp_passes.cp_compile(IdsMaskAttention(mask), mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError) as info:
        compiled(torch.randint(0, 32, (2, 8)))
    first = info.value.problems[0]
    assert first.op == "aten.scaled_dot_product_attention.default", str(info.value)
    built = "additive_mask_from_ids" if mask is _padding_and_causal else mask.__name__
    assert "additive and computed from 'input_ids'" in first.reason and f" in {built})" in first.reason, first.reason
    assert "attn_mask=(additive_mask == 0)" in first.fix, first.fix
    if mask is _padding_only:
        return  # bidirectional: the boolean form is refused by the causal envelope's run-time check
    fixed = cp_passes.cp_compile(IdsMaskAttention(lambda ids: mask(ids) == 0), mesh=group, backend="aot_eager",
                                 verbose=False)
    assert fixed(torch.randint(0, 32, (2, 8))).shape == (2, 8, 8)


@pytest.mark.parametrize("mix,line", [
    (lambda x: x + F.pad(x, (0, 0, 1, 0), value=float(x.shape[1]))[:, :x.shape[1]], "value=float(x.shape[1])"),
    (lambda x: x * x.shape[1] ** -0.5, "x * x.shape[1] ** -0.5"),
])
def test_a_float_computed_from_the_length_is_refused(group, mix, line):
    """The re-trace to ATen baked float(S) in as the local length's (a pad fill of 24.0 for a global 48)."""
    message = str(refusal(group, mix))
    assert "computes a float from the sequence length at tests/test_refusals.py" in message and line in message


class BlockLoop(nn.Module):
    """A decayed linear attention written as a Python loop over blocks of 4 positions in the forward (MiniMax's
    lightning attention's shape), then a norm module."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, ids):
        x = self.embed(ids)
        state, out, length = x.new_zeros(x.shape[0], 8, 8), [], x.shape[1]
        for i in range((length + 3) // 4):
            block = x[:, i * 4:min(i * 4 + 4, length)]
            out.append(block @ state + (block @ block.transpose(1, 2)).tril() @ block)
            state = 0.9 * state + block.transpose(1, 2) @ block
        return self.norm(torch.cat(out, 1)).sum()


def test_a_loop_over_the_sequence_is_refused_once_as_a_loop(group):
    """Dynamo unrolls the loop at the compile-time length: its slices, matmuls and the cat used to be refused one
    by one (a dozen problems); they are one problem naming the loop's lines and the declaration that serves it."""
    err = compile_error(group, BlockLoop(), cp_passes.CPSpec())
    assert len({p.key() for p in err.problems}) == 1, str(err)
    (problem,) = err.problems
    assert problem.op == "a Python loop" and "test_refusals.py:" in problem.source, problem
    assert problem.reason.startswith("a loop over the sequence written in Python"), problem.reason
    assert "Recurrence('module:function', ...)" in problem.fix


def test_minimax_s_lightning_attention_loop_is_refused_once_without_its_spec(group, monkeypatch):
    """MiniMax's lightning attention loops over blocks of the sequence inline in its forward: without the shipped
    spec (which lifts the loop: tests/test_hybrids.py), one problem per layer that runs it, not a slice per block,
    and the fix names the lifted form."""
    from transformers import MiniMaxConfig, MiniMaxForCausalLM
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    from cp_passes.lifted import shipped

    monkeypatch.setattr(MiniMaxLightningAttention, "forward", shipped(
        "transformers.models.minimax.modeling_minimax:MiniMaxLightningAttention.forward"))
    torch.manual_seed(0)
    model = MiniMaxForCausalLM(MiniMaxConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=32, num_local_experts=2, num_experts_per_tok=1, block_size=4, use_cache=False,
        layer_types=["linear_attention", "full_attention"]))
    compiled = cp_passes.cp_compile(model, cp_passes.CPSpec(layout="contiguous"), mesh=group, backend="aot_eager",
                                    verbose=False)
    with pytest.raises(CPCompileError) as info:
        compiled(**compiled.shard_batch({"input_ids": torch.randint(1, 64, (2, 64))})[0])
    (problem,) = info.value.problems
    assert problem.op == "a Python loop" and problem.source.startswith("minimax/modeling_minimax.py:"), problem
    assert "LiftedForward('module:Class.forward'" in problem.fix and "model_specs/minimax.py" in problem.fix
