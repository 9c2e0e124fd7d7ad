"""Mixture-of-experts layers as transformers ships them: the grouped_mm dispatch (sort the (token, expert)
pairs, gather, count per expert, grouped matmul, put back) is proven local to each rank, and MoE models match
one device, forward and gradients."""

import pytest
import torch

import cp_passes
import moe_models
from cp_passes import CPCompileError
from moe_models import HandMoE, reference
from parity import (GRAD_RTOL, OUT_TOL, compare, compare_valid, deepseek_v4_cut_floor, deepseek_v4_reference,
                    glm5_next_split_floor)
from shared import in_global_order, toy_batch


def _compare(name, family, ranks, seq_len, report, aux=False, documents=None):
    compare_valid(name, ranks, reference(family, seq_len, aux, documents), seq_len, report, aux)


MODELS = [pytest.param("mixtral", 2, [16, 11], marks=pytest.mark.full),
          pytest.param("mixtral", 4, [16, 13], marks=pytest.mark.full),
          pytest.param("olmoe", 2, [16, 11], marks=pytest.mark.full),
          pytest.param("olmoe", 4, [16], marks=pytest.mark.full),
          pytest.param("gpt_oss", 2, [16, 11], marks=pytest.mark.full),
          pytest.param("gpt_oss", 4, [16, 13], marks=pytest.mark.full),
          pytest.param("qwen2_moe", 2, [16, 11], marks=pytest.mark.full),
          pytest.param("qwen2_moe", 4, [16], marks=pytest.mark.full),
          pytest.param("llama4", 2, [16, 11]),
          pytest.param("llama4", 4, [32, 13], marks=pytest.mark.full)]


"""The default run's grouped_mm parity is test_router_aux_loss_is_global's (the same experts, labels= too)."""


@pytest.mark.parametrize("family,P,seq_lens", MODELS,
                         ids=[f"{c[0]}-P{c[1]}" for c in (getattr(m, "values", m) for m in MODELS)])
def test_grouped_mm_moe_matches_one_device(pool, parity_report, family, P, seq_lens):
    """The experts on transformers' default path, called with labels= (the loss of the model's own shift)."""
    per_rank = pool.run(moe_models.parity, P, family=family, seq_lens=seq_lens)
    for i, seq_len in enumerate(seq_lens):
        _compare(f"hf-{family}-grouped_mm-labels=", family, [r[i] for r in per_rank], seq_len, parity_report)
    moved = [(rule, source) for rule, _, _, source in per_rank[0][0]["records"] if "integrations/moe.py" in source]
    assert not moved, moved  # the experts move nothing between ranks


PACKED = [pytest.param(family, P, marks=pytest.mark.full) for family in ("mixtral", "olmoe", "gpt_oss")
          for P in (2, 4)]


@pytest.mark.parametrize("family,P", PACKED, ids=[f"{c.values[0]}-P{c.values[1]}" for c in PACKED])
def test_grouped_mm_moe_on_packed_rows_matches_one_device(pool, parity_report, family, P):
    """Packed rows (positions restarting at each document, from which transformers builds its masks; labels
    shifted inside each document): documents of 3, 9 and 4 positions, one across three ranks at P = 4."""
    documents = [[3, 9, 4], [8, 5, 3]]
    per_rank = pool.run(moe_models.parity, P, family=family, seq_lens=[16], documents=documents)
    _compare(f"hf-{family}-grouped_mm-packed", family, [r[0] for r in per_rank], 16, parity_report,
             documents=documents)


AUX = [("mixtral", 2), pytest.param("mixtral", 4, marks=pytest.mark.full),
       pytest.param("olmoe", 2, marks=pytest.mark.full), pytest.param("olmoe", 4, marks=pytest.mark.full),
       pytest.param("gpt_oss", 2, marks=pytest.mark.full), pytest.param("gpt_oss", 4, marks=pytest.mark.full)]


@pytest.mark.parametrize("family,P", AUX, ids=[f"{c[0]}-P{c[1]}" for c in (getattr(m, "values", m) for m in AUX)])
def test_router_aux_loss_is_global(pool, parity_report, family, P):
    """output_router_logits=True: the load-balancing loss (per-expert token fractions times mean router
    probabilities, summed over layers, each a sum over all rows divided by the row count) is the single-device
    value on every rank, and its gradient reaches each rank's tokens: each mean is this rank's sum over the global
    count (the count all-reduced), the two means are all-reduced before their product, and the loss adds its
    1 / P to each rank's share of the cross-entropy."""
    per_rank = pool.run(moe_models.parity, P, family=family, seq_lens=[16], aux=True)
    _compare(f"hf-{family}-grouped_mm-router-aux", family, [r[0] for r in per_rank], 16, parity_report, aux=True)
    rules = [rule for rule, _, _, source in per_rank[0][0]["records"] if "load_balancing" in source]
    assert rules.count("global_count") == 2 and rules.count("global_sum") == 1, rules
    moved = [(rule, source) for rule, _, _, source in per_rank[0][0]["records"] if "integrations/moe.py" in source]
    assert not moved, moved  # the experts move nothing between ranks


def test_hand_written_dispatch_matches_one_device(pool):
    """argsort / sort, gathers by perm // k or index_select, put back by index_add, index_put, the inverse as
    argsort(perm) or inv[perm] = arange(n), experts as per-row weights or transformers' grouped matmul; and a
    loop over the experts selecting each one's rows by a boolean mask and writing them back by it."""
    import transformers.integrations.moe  # noqa: F401

    seq_len = 13
    per_rank = pool.run(moe_models.hand_moe_parity, 2, seq_len=seq_len)
    ids = toy_batch(seq_len, 2, vocab=64)["input_ids"]
    for variant in HandMoE.VARIANTS:
        torch.manual_seed(0)
        model = HandMoE(variant)
        ref = model(ids)
        ref.square().sum().backward()
        ranks = [r[variant] for r in per_rank]
        out = in_global_order(ranks, "logits")[:, :seq_len]
        assert (out - ref).abs().max().item() <= OUT_TOL, variant
        for name, p in model.named_parameters():
            total = sum(r["grads"][name] for r in ranks)
            assert ((total - p.grad).abs().max() / p.grad.abs().max()).item() <= GRAD_RTOL, (variant, name)


def _sorted(x, ids):
    keys, perm = ids.sort()
    return keys, perm, x.repeat_interleave(2, 0)[perm]


def _counts(keys):
    return torch.histc(keys.float(), bins=4, min=0, max=3)


BROKEN = {
    "rows_meet_sequence_order": (lambda x, ids: x.repeat_interleave(2, 0) + _sorted(x, ids)[2],
                                 "aten.add.Tensor", "rows in sequence order"),
    "reordered_rows_returned": (lambda x, ids: _sorted(x, ids)[2], "returns", "each rank orders only its own rows"),
    "counts_read_as_numbers": (lambda x, ids: x * _counts(_sorted(x, ids)[0]).max(), "aten.max.default",
                               "per-group counts of this rank's rows"),
    "running_sum_over_reordered_rows": (lambda x, ids: _sorted(x, ids)[2].cumsum(0), "aten.cumsum.default",
                                        "the running value would cross"),
    "per_expert_sums": (lambda x, ids: torch.zeros(4, x.shape[1]).index_add(0, _sorted(x, ids)[0], _sorted(x, ids)[2]),
                        "aten.index_add.default", "not a sort's indices"),
    "groups_of_another_sort": (
        lambda x, ids: torch.ops.transformers.grouped_mm_fallback(
            _sorted(x, ids)[2], torch.ones(4, x.shape[1], x.shape[1]),
            offs=_counts(_sorted(x, 3 - ids)[0]).cumsum(0, dtype=torch.int32)),
        "transformers.grouped_mm_fallback", "not the counts of the sort that ordered its rows"),
    "back_by_another_sorts_inverse": (lambda x, ids: _sorted(x, ids)[2][ids.argsort().argsort()],
                                      "aten.index.Tensor", "other than by the sort's inverse"),
    "selected_rows_summed": (lambda x, ids: x + x[ids[::2] == 0].sum(0), "aten.sum.dim_IntList",
                             "other than row by row"),
    "selected_rows_returned": (lambda x, ids: x[ids[::2] == 0], "returns", "each rank orders only its own rows"),
    "selected_rows_put_back_by_another_mask": (
        lambda x, ids: torch.zeros_like(x).index_put((ids[::2] == 1,), x[ids[::2] == 0] * 2),
        "aten.index_put.default", "not a sort's indices"),
}


class Dispatch(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.embed, self.router, self.fn = torch.nn.Embedding(32, 8), torch.nn.Linear(8, 4), fn

    def forward(self, input_ids):
        x = self.embed(input_ids).flatten(0, 1)
        return self.fn(x, self.router(x).topk(2, -1).indices.flatten())


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_reordering_that_reaches_other_rows_is_refused(group, case):
    """Each form lets a row the sort (or a boolean mask) moved meet a row in sequence order, a count, a positional
    transport, a tensor without the sequence, another sort's groups or inverse, another mask, or the caller."""
    import transformers.integrations.moe  # noqa: F401

    import cp_passes

    fn, op, words = BROKEN[case]
    compiled = cp_passes.cp_compile(Dispatch(fn), mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(cp_passes.CPCompileError) as info:
        compiled(torch.randint(0, 32, (2, 8)))
    message = str(info.value)
    assert op in message and words in message and "moe.py" not in message.split("\n")[0], message


def test_router_aux_loss_on_a_padded_batch_is_refused(group):
    """shard_batch pads 11 positions to 16 at P = 8: the row count and the router's sums would count the padded
    rows, so the first call refuses, naming both."""
    import cp_passes
    from moe_models import batch, build

    compiled = cp_passes.cp_compile(build("mixtral", aux=True), mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(batch(11), group)
    with pytest.raises(cp_passes.CPCompileError) as info:
        compiled(**local)
    message = str(info.value)
    assert "a division by a row count" in message and "load_balancing_loss_func" in message, message


@pytest.mark.parametrize("P,kpool", [(2, 8), pytest.param(4, 16, marks=pytest.mark.full)])
def test_glm5_next_shared_indexer_and_moe_match_one_device(pool, parity_report, P, kpool):
    """Glm5NextTextModel with a full and a shared indexer (the second layer reuses the first's top-k), pools of
    8 or 16 keys, MoE layers: the indexers' top-k masks are evaluated over the whole sequence for both
    attentions, 32 positions a rank. The gradient tolerance is the family's: twice the one-device floor of
    computing as CP does (the KDA layer's affine carry and block attention, parity.glm5_next_split_floor)."""
    from family_models import glm5_next_batch
    from moe_models import glm5_next

    seq_len = 32 * P
    per_rank = pool.run(moe_models.glm5_next_parity, P, kpool=kpool, seq_len=seq_len)
    model = glm5_next(kpool)
    out = model(**glm5_next_batch(seq_len)).last_hidden_state
    loss = out.pow(2).sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    floor = glm5_next_split_floor(P, glm5_next_batch(seq_len), None, build=lambda: glm5_next(kpool))
    tolerance = max(GRAD_RTOL, 2 * floor)
    compare(f"hf-Glm5NextTextModel-shared-indexer-kpool{kpool}-moe (grad tol {tolerance:.1e})", per_rank,
            loss.detach(), out.detach(), grads, seq_len, parity_report, grad_rtol=tolerance)


@pytest.mark.parametrize("P", [pytest.param(2, marks=pytest.mark.full), pytest.param(4, marks=pytest.mark.full)])
def test_deepseek_v4_router_aux_loss_is_global(pool, parity_report, P):
    """DeepseekV4ForCausalLM with output_router_logits=True: its load-balancing loss over the routed layers
    joins the loss; loss, aux_loss and gradients match one device, within the family's tolerance (twice the
    one-device floor of cutting its loss as CP does, parity.deepseek_v4_cut_floor)."""
    from family_models import deepseek_v4_batch
    from moe_models import deepseek_v4

    seq_len = 8 * P
    per_rank = pool.run(moe_models.deepseek_v4_aux_parity, P, seq_len=seq_len)
    model = deepseek_v4()
    batch = deepseek_v4_batch(seq_len=seq_len)
    ref = model(**batch, labels=batch["shift_labels"])
    ref.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    # the model without its router loss, cut as CP cuts it
    floor_batch, _, _, floor_grads = deepseek_v4_reference(P, None)
    tolerance = max(GRAD_RTOL, 2 * deepseek_v4_cut_floor(P, floor_batch, floor_grads))
    compare(f"hf-DeepseekV4ForCausalLM-router-aux (grad tol {tolerance:.1e})", per_rank, ref.loss.detach(),
            ref.logits.detach(), grads, seq_len, parity_report, grad_rtol=tolerance)
    for r in per_rank:
        assert abs(r["aux_loss"].item() - ref.aux_loss.item()) <= OUT_TOL * abs(ref.aux_loss.item())


def test_rows_repeated_end_to_end_and_split_the_other_way_are_refused(group):
    """``x.repeat(E, 1)`` lays E copies of the token rows end to end (Llama 4's MoE; HandMoE's repeat_per_expert
    matches one device); viewed as ``[tokens, E, d]`` the neighbours of a row would be other tokens' copies, which
    differ on a shard: refused, naming the view."""
    compiled = cp_passes.cp_compile(HandMoE("repeat_split_inner"), mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError, match=r"repeats the rows 4 times .* splits that axis with the copies as the "
                                             r"inner factor"):
        compiled(torch.randint(0, 64, (2, 8)))
