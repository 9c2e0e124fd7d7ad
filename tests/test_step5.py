"""Step-5's public relative, transformers' Step3p7TextModel with model_specs/step5.py: sliding-window layers
by halo, full-attention layers by gather, MoE layers with the experts as shipped (the spec runs their loop as
grouped_mm). Parity on real gloo processes against one device, unpacked and packed; the untraceable experts
loop refused with its fix."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import cp_passes
from cp_passes import CPCompileError
from cp_passes.data.batch import shard_for_rank
from cp_passes.layout import resolve_layout
from family_models import step3p7_text
from parity import GRAD_RTOL, blockwise_sdpa, compare, split_floor
from shared import step_result


def hf_step3p7(seed: int = 0, moe: bool = True):
    """A tiny Step3p7TextModel (Step-5's public relative) as transformers 5.24 ships it: sliding-window layers
    (window 4) and full-attention layers, per-head q/k norms, partial RoPE, gated attention output; a dense MLP
    first, then MoE layers (4 experts, top 2, a shared expert) whose experts loop over nonzero() (the step5 spec
    runs them through transformers' grouped_mm forward)."""
    from transformers import Step3p7TextConfig, Step3p7TextModel

    torch.manual_seed(seed)
    return Step3p7TextModel(Step3p7TextConfig(**step3p7_text(moe))).float()


def step3p7_batch(documents: list[list[int]] | None = None, seq_len: int = 16) -> dict:
    """Token ids with positions, or packed rows (one list of document lengths per row)."""
    length = sum(documents[0]) if documents else seq_len
    ids = torch.randint(1, 128, (2, length), generator=torch.Generator().manual_seed(4))
    if documents:
        return {"input_ids": ids, "seq_lens": torch.tensor(documents)}
    return {"input_ids": ids, "position_ids": torch.arange(length).expand(2, length)}

PACKED = [[3, 9, 4], [8, 4, 4]]
"""Row 0 at P = 4 (4 a rank): the second document spans ranks 0, 1 and 2 (positions 3..11), the third is
rank 3's; row 1's documents start at shard boundaries."""


def _reference(P: int, documents):
    """One device on the global batch as shard_batch lays it out for ``P`` ranks."""
    model = hf_step3p7()
    batch, _ = shard_for_rank(step3p7_batch(documents, 4 * max(P, 2)), 0, 1, "step5", pad_multiple=2 * P)
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
    loss = out.pow(2).sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return batch, loss.detach(), out.detach(), grads


def _cut_floor(P: int, batch: dict, grads: dict) -> float:
    """The model's one-device floor (:func:`split_floor`) cut as the spec's layout cuts it (balanced: 2P
    chunks): each chunk's queries attend to the keys up to its own last one only, and the gradient is summed
    from each rank's loss (its chunks'). The MoE's expert gradients, summed over the few tokens routed to an
    expert, move by up to 2.4e-5 of their size (packed, P = 4, contiguous). The experts run as CP runs them:
    through the spec's grouped_mm forward, on each rank's tokens apart (:func:`_experts_per_rank`)."""
    spec = cp_passes.load_spec("step5")
    layout = resolve_layout(spec, P)[0]
    model = hf_step3p7()
    local = batch["input_ids"].shape[1] // P
    _experts_per_rank(model, spec.experts, [layout.positions(r, local) for r in range(P)], batch["input_ids"].shape)
    with mock.patch.object(F, "scaled_dot_product_attention", blockwise_sdpa(P * layout.chunks)):
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
    return split_floor(model, [out[:, layout.positions(r, local)].pow(2).sum() for r in range(P)], grads)


def _experts_per_rank(model, globs: tuple, positions: list, shape) -> None:
    """Run ``model``'s experts as each CP rank does: the spec's grouped_mm forward (:mod:`cp_passes.experts`), on
    the tokens at each rank's ``positions`` of every row apart, the results put back in token order. The expert
    gradients then sum over each rank's tokens first, as CP's do (the experts' share of the floor)."""
    batch, length = shape
    rows = [torch.cat([b * length + p for b in range(batch)]) for p in positions]
    back = torch.argsort(torch.cat(rows))
    for path in cp_passes.experts.install(model, globs):
        module = model.get_submodule(path)

        def forward(hidden, index, weights, grouped=module.forward):
            parts = [grouped(hidden[r], index[r], weights[r]) for r in rows]
            return torch.cat(parts)[back]

        module.forward = forward


CASES = [(2, None), pytest.param(1, None, marks=pytest.mark.full), pytest.param(2, PACKED, marks=pytest.mark.full),
         pytest.param(4, None, marks=pytest.mark.full), pytest.param(4, PACKED, marks=pytest.mark.full)]
"""Unpacked at P = 2 by default. Packed at P = 2 misses its tolerance on an AMD EPYC (expert down_proj 3.82e-05
against 3.5e-05, the same at 668c913, before the key mover): the floor's emulation of CP's rounding does not yet
cover every order in which CP sums the experts' gradients; packed rows run at P = 4 under -m full."""


@pytest.mark.parametrize("P,documents", CASES)
def test_step3p7_with_moe_matches_one_device(pool, parity_report, P, documents):
    """Two sliding-window layers (window 4: a halo of 3 rows, from up to two ranks at 4 a rank) and two
    full-attention layers (the causal prefix of an all-gather of K and V), a dense MLP and three MoE layers.
    Packed rows: the masks transformers builds from per-document positions keep the documents apart, here as
    on one device."""
    per_rank = pool.run(step3p7_parity, P, documents=documents, seq_len=4 * max(P, 2))
    batch, loss, out, grads = _reference(P, documents)
    name = f"hf-Step3p7TextModel-moe-{'packed' if documents else 'unpacked'}-aot_eager"
    if documents:
        assert batch["doc_ids"][0].tolist() == [0] * 3 + [1] * 9 + [2] * 4, batch["doc_ids"]
    # At P = 1 the cut is no cut; the model's sensitivity to rounding is read from a cut in two.
    tolerance = max(GRAD_RTOL, 2 * _cut_floor(max(P, 2), batch, grads))
    compare(f"{name} (grad tol {tolerance:.1e})", per_rank, loss, out, grads, out.shape[1], parity_report,
             grad_rtol=tolerance)
    rules = [(rec[0], rec[1]) for rec in per_rank[0]["records"]]
    assert rules == [("sdpa_data_mask", "halo"), ("sdpa_data_mask", "sequence_gather")] * 2, rules


def test_untraceable_experts_are_refused_with_the_fix(fake_group):
    """transformers 5.24 generates Step3p7Experts without its experts-implementation switch: its forward loops
    over nonzero(), which dynamo cannot trace. Without the step5 spec (which names them in experts) the refusal
    names the module and the spec field that runs them through grouped_mm."""
    model = hf_step3p7()
    spec = cp_passes.load_spec("step5").replace(experts=())
    compiled = cp_passes.cp_compile(model, spec, mesh=fake_group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(step3p7_batch(seq_len=64), fake_group, spec)
    with pytest.raises(CPCompileError, match=r"layers\.1\.mlp\.experts.*CPSpec\(experts=\('\*mlp\.experts',\)\)"):
        compiled(input_ids=local["input_ids"], position_ids=local["position_ids"])


# Tasks the worker pool's ranks run (pool.run(task, P, ...)).


def step3p7_parity(group, documents: list[list[int]] | None = None, seq_len: int = 16) -> dict:
    """Step3p7TextModel with model_specs/step5.py on a batch sharded by shard_batch; the loss is the sum of
    squares of the last hidden states."""
    model = hf_step3p7()
    compiled = cp_passes.cp_compile(model, "step5", mesh=group, backend="aot_eager", verbose=False)
    local, layout = cp_passes.shard_batch(step3p7_batch(documents, seq_len), group, "step5")
    out = compiled(input_ids=local["input_ids"], position_ids=local["position_ids"]).last_hidden_state
    loss = out.pow(2).sum()
    loss.backward()
    return step_result(model, compiled, loss, out, layout)
