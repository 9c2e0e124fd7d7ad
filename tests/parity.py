"""Comparing a CP run with one device: every rank's results against the single-device reference (forward,
loss and gradients), the tolerances, and the one-device floors a family's tolerance is read from (the same math
computed as CP computes it: split into blocks, cut to the keys CP brings, carried across parts). Test modules
import these by name; no test module imports another."""

from __future__ import annotations

import math
from unittest import mock

import torch
import torch.nn.functional as F

from cp_passes.data.batch import shard_for_rank
from cp_passes.layout import resolve_layout
import cp_passes
from family_models import (HF_MODELS, deepseek_v4_batch, deepseek_v4_loss, deepseek_v4_spec, hf_batch, hf_deepseek_v4,
                           hf_glm5_next, hf_step3p7, step3p7_batch)
from shared import in_global_order, mixer_batch, toy_batch, toy_model

OUT_TOL = 1e-5
GRAD_RTOL = 1e-5
CANCELLED = 1e-4
"""A gradient that cancels to less than this fraction of the model's largest gradient entry (DeepSeek V4's
hc_head.hc_scale: 3.3e-6 against 4.9) is compared on that floor: its rounding is the model's, not its own
(measured at P = 4, packed, grouped-mm experts: 7.5e-10 of the largest entry, 1.1e-3 of its own)."""


def _errors(results_by_rank, ref_loss, ref_logits, ref_grads, seq_len) -> tuple[float, float, float, str]:
    """The largest logits error, the loss's relative error, the largest relative gradient error and the parameter
    it is at, as :func:`compare` measures them."""
    logits = in_global_order(results_by_rank, "logits")
    valid = in_global_order(results_by_rank, "valid")
    assert valid.shape[1] >= seq_len and bool(valid[:, :seq_len].all()) and not bool(valid[:, seq_len:].any())
    out_err = (logits[:, :seq_len] - ref_logits).abs().max().item()
    loss = sum(r["loss"] for r in results_by_rank)
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    grad_err = 0.0
    assert set(results_by_rank[0]["grads"]) == set(ref_grads)
    worst = ""
    floor = CANCELLED * max(g.abs().max().item() for g in ref_grads.values())
    for pname, ref in ref_grads.items():
        total = sum(r["grads"][pname] for r in results_by_rank)
        err = ((total - ref).abs().max() / max(ref.abs().max().item(), floor)).item()
        err = math.inf if math.isnan(err) else err  # max() would skip a NaN
        if err > grad_err or not worst:
            grad_err, worst = err, pname
    return out_err, loss_err, grad_err, worst


def compare(name, results_by_rank, ref_loss, ref_logits, ref_grads, seq_len, report, grad_rtol=GRAD_RTOL):
    """Every rank's ``logits`` (in global order, the first ``seq_len`` positions valid), the sum of their
    ``loss`` and of their ``grads`` against one device's, gradients relative to each parameter's largest entry
    (or to :data:`CANCELLED` of the model's, where larger); the errors are appended to ``report``."""
    out_err, loss_err, grad_err, worst = _errors(results_by_rank, ref_loss, ref_logits, ref_grads, seq_len)
    report.append((name, len(results_by_rank), seq_len, out_err, loss_err, grad_err))
    assert out_err <= OUT_TOL, f"{name}: logits differ by {out_err}"
    assert loss_err <= OUT_TOL, f"{name}: loss differs by {loss_err} (relative)"
    assert grad_err <= grad_rtol, f"{name}: gradients differ by {grad_err} (relative, {worst})"


def compare_small(name, results_by_rank, build, seq_len, report):
    """:func:`compare` against ``build()`` (seeded with 0, as the ranks build it) run on one device on
    ``mixer_batch(seq_len)``, the model called as ``loss, out = model(input_ids=...)``."""
    torch.manual_seed(0)
    model = build()
    loss, out = model(**mixer_batch(seq_len))
    loss.backward()
    compare(name, results_by_rank, loss.detach(), out.detach(), {n: p.grad for n, p in model.named_parameters()},
            seq_len, report)


def compare_within_floor(name, results_by_rank, ref_loss, ref_logits, ref_grads, seq_len, report, floor):
    """:func:`compare` with a family's gradient tolerance, the larger of :data:`GRAD_RTOL` and twice its
    one-device floor; ``floor()`` (a whole one-device run or more at long lengths) is computed only when the
    gradients miss :data:`GRAD_RTOL`, where it alone can decide: within it the tolerance is that."""
    grad_err = _errors(results_by_rank, ref_loss, ref_logits, ref_grads, seq_len)[2]
    tolerance = GRAD_RTOL if grad_err <= GRAD_RTOL else max(GRAD_RTOL, 2 * floor())
    compare(f"{name} (grad tol {tolerance:.1e})", results_by_rank, ref_loss, ref_logits, ref_grads, seq_len, report,
            grad_rtol=tolerance)


def compare_valid(name, ranks, reference, seq_len, report, aux=False, grad_rtol=GRAD_RTOL):
    """Every rank's result (``logits``, ``loss``, ``grads``, ``aux_loss`` with ``aux``) against the single-device
    ``reference`` ``(output, gradients, valid positions)`` on the valid positions of a length-``seq_len`` batch
    (a packed one's documents); ``grad_rtol`` a family's gradient tolerance where its one-device floor is above
    the suite's."""
    ref, ref_grads, valid = reference
    logits = in_global_order(ranks, "logits")[:, :seq_len]
    out_err = (logits - ref.logits.detach())[valid].abs().max().item()
    loss = sum(r["loss"] for r in ranks)
    loss_err = abs(loss.item() - ref.loss.item()) / abs(ref.loss.item())
    errs = {n: ((sum(r["grads"][n] for r in ranks) - g).abs().max() / g.abs().max()).item()
            for n, g in ref_grads.items()}
    assert set(ranks[0]["grads"]) == set(ref_grads)
    grad_err = math.inf if any(map(math.isnan, errs.values())) else max(errs.values())
    report.append((name, len(ranks), seq_len, out_err, loss_err, grad_err))
    assert out_err <= OUT_TOL, f"{name}: logits differ by {out_err}"
    assert loss_err <= OUT_TOL, f"{name}: loss differs by {loss_err} (relative)"
    assert grad_err <= grad_rtol, f"{name}: gradients differ by {grad_err} ({max(errs, key=errs.get)})"
    if aux:
        for r in ranks:  # every rank holds the global router loss
            assert abs(r["aux_loss"].item() - ref.aux_loss.item()) <= OUT_TOL * abs(ref.aux_loss.item())


def split_floor(model, losses, grads) -> float:
    """How far one device's own gradients move (relative to each parameter's largest entry, the largest over
    parameters) when they are summed from the per-block ``losses`` of ``model``'s forward, as CP sums each
    rank's gradients (the forward attending per block as CP does): the same math, rounded differently. No CP
    run can be expected closer. Rounding moves every gradient by a rounding error of the model's gradient
    scale (a bug would move one by more); one that cancels to a small total (a hyper-connection's scale)
    moves by that much relative to itself."""
    named = [(n, p) for n, p in model.named_parameters() if n in grads]
    parts = [torch.autograd.grad(loss, [p for _, p in named], retain_graph=True, allow_unused=True) for loss in losses]
    largest = max(g.abs().max().item() for g in grads.values())
    floor = 0.0
    for i, (name, p) in enumerate(named):
        total = sum(part[i] if part[i] is not None else torch.zeros_like(p) for part in parts)
        moved = (total - grads[name]).abs().max().item()
        assert moved < 1e-5 * largest, f"the split one-device run moves {name}'s gradient by {moved}: a bug there"
        floor = max(floor, moved / grads[name].abs().max().item())
    return floor


def blockwise_sdpa(P: int):
    """SDPA as CP runs it on one device: each of P query blocks attends to the keys up to its own last one
    only (for :func:`split_floor`)."""
    sdpa = F.scaled_dot_product_attention

    def cut(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        local, outs = q.shape[-2] // P, []
        for start in range(0, q.shape[-2], local):
            end = start + local
            mask = (attn_mask[..., start:end, :end] if attn_mask is not None else
                    torch.ones(local, end, dtype=torch.bool).tril(start) if is_causal else None)
            outs.append(sdpa(q[..., start:end, :], k[..., :end, :], v[..., :end, :], attn_mask=mask,
                             dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa))
        return torch.cat(outs, -2)

    return cut


def toy_reference(config, seq_len, pass_positions):
    model = toy_model(**config)
    batch = toy_batch(seq_len)
    if not pass_positions:
        batch.pop("position_ids")
    loss, logits = model(**batch)
    loss.backward()
    return loss.detach(), logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def hf_reference(seq_len, mean_loss, labels_in_model=False, family="llama", position_ids=True, rows=2):
    model = HF_MODELS[family]()
    if labels_in_model:
        out = model(**hf_batch(seq_len, rows, labels_in_model=True, position_ids=position_ids))
        out.loss.backward()
        return out.loss.detach(), out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    batch = hf_batch(seq_len, rows, position_ids=position_ids)
    count = (batch["shift_labels"] != -100).sum()
    out = model(**batch, labels=batch["shift_labels"], **({} if mean_loss else {"num_items_in_batch": count}))
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def blocked_sdpa(P: int, sdpa):
    """SDPA as CP computes it: each of P query chunks attends to the keys before its end in P key pieces
    (``cp_passes::block_attention``, merged by logsumexp); a boolean mask is cut the same way."""
    from cp_passes.key_plan import CAUSAL, FULL
    from cp_passes.transports.block_attention import block_attention_op

    def blocked(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.dim() != 4 or (attn_mask is not None and attn_mask.dtype != torch.bool) or q.shape[-2] % P:
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
        local = q.shape[-2] // P
        outs = []
        for r in range(P):
            rows, keys = slice(r * local, (r + 1) * local), (r + 1) * local
            mask = None if attn_mask is None else attn_mask[..., rows, :keys]
            bounds = [j * local for j in range(r + 2)] if mask is not None else [0, r * local, keys][r == 0:]
            kinds = [FULL] * (r + 1) if mask is not None else [FULL, CAUSAL][r == 0:]
            outs.append(block_attention_op(q[..., rows, :], k[..., :keys, :], v[..., :keys, :], mask, [0, local],
                                           bounds, kinds, q.shape[-1] ** -0.5 if scale is None else scale)[0])
        return torch.cat(outs, -2)

    return blocked


def glm5_next_reference(batch: dict, layer_types):
    """One device: the loss (the sum of squares of the last hidden states, as glm5_next_parity's), the output
    and the gradients of :func:`hf_glm5_next` with ``layer_types`` on ``batch``."""
    model = hf_glm5_next(layer_types=layer_types)
    out = model(**batch).last_hidden_state
    loss = out.pow(2).sum()
    loss.backward()
    return loss.detach(), out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def glm5_next_split_floor(P: int, batch: dict, layer_types, build=None) -> float:
    """How far one device's own gradients move (relative, the largest over parameters) when it computes as CP
    does, on the batch the check compares: its KDA kernel as the affine carry (each of P parts from zero and
    from [0 | I] on values extended by K zero columns, the maps folded, each part run again from its state),
    its attention as block attention (P query chunks, each over P key pieces merged by logsumexp), or both.
    The same math, rounded differently; each is one sample of the rounding noise of a gradient that cancels
    (at P = 4 the three move the indexed layer's hyper-connection scale by 2.1e-4, 7.9e-4 and 2.2e-4 of its
    size), so the largest of them is the floor. No CP run can be expected closer. ``build`` makes the model
    (default: :func:`hf_glm5_next` with ``layer_types``)."""
    from transformers.models.glm5_next import modeling_glm5_next as glm

    kernel, sdpa = glm.chunk_kimi_delta_attention, torch.nn.functional.scaled_dot_product_attention

    def affine(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
        local, (n_k, n_v) = query.shape[1] // P, (key.shape[-1], value.shape[-1])
        parts = [[x[:, r * local:(r + 1) * local] for x in (query, key, value, g, beta)] for r in range(P)]
        batch = (value.shape[0], value.shape[2])
        start = torch.cat([torch.zeros(*batch, n_k, n_v), torch.eye(n_k).expand(*batch, n_k, n_k)], -1)
        maps = [kernel(q, k, torch.cat([v, v.new_zeros(*v.shape[:-1], n_k)], -1), gr, b, initial_state=start,
                       output_final_state=True, **kwargs)[1] for q, k, v, gr, b in parts]
        outs, state = [], torch.zeros(*batch, n_k, n_v)
        for part, hm in zip(parts, maps):
            outs.append(kernel(*part, initial_state=state, output_final_state=True, **kwargs)[0])
            state = hm[..., n_v:] @ state + hm[..., :n_v]
        return torch.cat(outs, 1), state

    blocked = blocked_sdpa(P, sdpa)
    grads = []
    for fn, attention in ((kernel, sdpa), (affine, sdpa), (kernel, blocked), (affine, blocked)):
        glm.chunk_kimi_delta_attention, torch.nn.functional.scaled_dot_product_attention = fn, attention
        try:
            model = build() if build is not None else hf_glm5_next(layer_types=layer_types)
            model(**batch).last_hidden_state.pow(2).sum().backward()
        finally:
            glm.chunk_kimi_delta_attention, torch.nn.functional.scaled_dot_product_attention = kernel, sdpa
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    largest = max(g.abs().max().item() for g in grads[0].values())
    floor = 0.0
    for variant in grads[1:]:
        for name, g in grads[0].items():
            moved = (variant[name] - g).abs().max().item()
            # Rounding moves every gradient by a rounding error of the model's gradient scale (a bug there would
            # move it by more, and hide one here); one that cancels to a small total (a hyper-connection's
            # scale) moves by that much relative to itself.
            assert moved < 1e-5 * largest, f"the one-device split run moves {name}'s gradient by {moved}: a bug there"
            floor = max(floor, moved / g.abs().max().item())
    return floor


def deepseek_v4_reference(P: int, documents, layers: int = 3, seq_len: int | None = None, rows: int = 2):
    """One device on the global batch (``seq_len`` positions, 8 a rank by default; ``rows`` unpacked rows) as
    shard_batch lays it out for ``P`` ranks (the same padding)."""
    model = hf_deepseek_v4(layers=layers)
    batch, _ = shard_for_rank(deepseek_v4_batch(documents, 8 * P if seq_len is None else seq_len, rows), 0, 1,
                              deepseek_v4_spec(), pad_multiple=8 * P)
    loss, logits = deepseek_v4_loss(model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return batch, loss.detach(), logits.detach(), grads


def deepseek_v4_cut_floor(P: int, batch: dict, grads: dict, layers: int = 3) -> float:
    """The model's one-device floor (:func:`split_floor`) cut as the spec's layout cuts it (balanced: 2P
    chunks): each chunk's queries attend only to the keys cp_passes brings them (the ``window - 1`` raw keys
    before it, its own, every compressed entry), and the gradient is summed from each rank's loss."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ds

    eager = ds.eager_attention_forward
    layout = resolve_layout(deepseek_v4_spec(), P)[0]

    def cut(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        length, halo = query.shape[2], module.config.sliding_window - 1
        local, outs = length // (P * layout.chunks), []
        for start in range(0, length, local):
            keys = torch.cat([torch.arange(max(start - halo, 0), start + local), torch.arange(length, key.shape[2])])
            rows = attention_mask[:, :, start:start + local][..., keys]
            outs.append(eager(module, query[:, :, start:start + local], key[:, :, keys], value[:, :, keys], rows,
                              scaling, dropout, **kwargs)[0])
        return torch.cat(outs, 1), None

    model = hf_deepseek_v4(layers=layers)
    with mock.patch.object(ds, "eager_attention_forward", cut):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    local = logits.shape[1] // P
    rows = [layout.positions(r, local) for r in range(P)]
    losses = [F.cross_entropy(logits[:, pos].flatten(0, 1), batch["shift_labels"][:, pos].flatten(), reduction="sum")
              for pos in rows]
    return split_floor(model, losses, grads)


def step3p7_reference(P: int, documents, seq_len: int | None = None):
    """One device on the global batch (``seq_len`` positions, 4 a rank at P = 2 and 4 by default) as shard_batch
    lays it out for ``P`` ranks."""
    model = hf_step3p7()
    length = 4 * max(P, 2) if seq_len is None else seq_len
    batch, _ = shard_for_rank(step3p7_batch(documents, length), 0, 1, "step5", pad_multiple=2 * P)
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
    loss = out.pow(2).sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return batch, loss.detach(), out.detach(), grads


def step3p7_cut_floor(P: int, batch: dict, grads: dict) -> float:
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
