"""Mixture-of-experts layers as transformers ships them: the grouped_mm dispatch (sort the (token, expert)
pairs, gather, count per expert, grouped matmul, put back) is proven local to each rank, and MoE models match
one device, forward and gradients."""

import math

import pytest
import torch

from moe_models import reference
from scenarios import in_global_order
from test_parity import GRAD_RTOL, OUT_TOL


def _compare(name, family, ranks, seq_len, report, aux=False, documents=None):
    ref, ref_grads, valid = reference(family, seq_len, aux, documents)
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
    assert grad_err <= GRAD_RTOL, f"{name}: gradients differ by {grad_err} ({max(errs, key=errs.get)})"
    if aux:
        for r in ranks:  # every rank holds the global router loss
            assert abs(r["aux_loss"].item() - ref.aux_loss.item()) <= OUT_TOL * abs(ref.aux_loss.item())


MODELS = [("mixtral", 2, [16, 11]), pytest.param("mixtral", 4, [16, 13], marks=pytest.mark.full),
          pytest.param("olmoe", 2, [16, 11], marks=pytest.mark.full),
          pytest.param("olmoe", 4, [16], marks=pytest.mark.full),
          pytest.param("gpt_oss", 2, [16, 11], marks=pytest.mark.full),
          pytest.param("gpt_oss", 4, [16, 13], marks=pytest.mark.full)]


@pytest.mark.parametrize("family,P,seq_lens", MODELS,
                         ids=[f"{c[0]}-P{c[1]}" for c in (getattr(m, "values", m) for m in MODELS)])
def test_grouped_mm_moe_matches_one_device(pool, parity_report, family, P, seq_lens):
    per_rank = pool.run("moe_models:parity", P, family=family, seq_lens=seq_lens)
    for i, seq_len in enumerate(seq_lens):
        _compare(f"hf-{family}-grouped_mm-labels=", family, [r[i] for r in per_rank], seq_len, parity_report)
    moved = [(rule, source) for rule, _, _, source in per_rank[0][0]["records"] if "integrations/moe.py" in source]
    assert not moved, moved  # the experts move nothing between ranks
