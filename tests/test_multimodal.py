"""Vision-language models: image features every rank computes whole, spliced into its slice of the sequence
from an exclusive scan of the ranks' image-token counts; the model's own count check sees the global count."""

import pytest
import torch

from cp_passes.layout import Layout
from cp_passes.transports.splice import row_counts, spliced
from scenarios import MeasuredSplice, hf_step3p7_vlm, measured_splice_batch, vlm_batch
from test_parity import _compare


@pytest.mark.parametrize("world,mask_shape", [(2, (2, 8, 1)), (4, (3, 8, 5)), (3, (1, 9, 1))])
def test_each_rank_splices_the_features_masked_scatter_puts_at_its_positions(world, mask_shape):
    """Every rank's spliced rows, side by side, are masked_scatter on the whole batch: masks broadcast over the
    hidden dim or not, several rows, masked runs crossing rank boundaries."""
    generator = torch.Generator().manual_seed(world)
    x = torch.randn(mask_shape[0], mask_shape[1], 5, generator=generator)
    mask = torch.rand(mask_shape, generator=generator) < 0.5
    source = torch.randn(int(mask.expand(x.shape).sum()) + 3, generator=generator)
    layout = Layout(world)
    shards = [(layout.shard(x, 1, r), layout.shard(mask, 1, r)) for r in range(world)]
    counts = torch.cat([row_counts(xs, ms) for xs, ms in shards])
    local = [spliced(xs, ms, source, counts, r, world) for r, (xs, ms) in enumerate(shards)]
    assert torch.equal(torch.cat(local, 1), x.masked_scatter(mask, source))


@pytest.mark.parametrize("P", [2, pytest.param(4, marks=pytest.mark.full)])
def test_step3p7_with_images_across_ranks_matches_one_device(pool, parity_report, P):
    """Step3p7ForConditionalGeneration with "step5": three images of 4 tokens, one crossing position 8 (rank
    boundary at P = 2 and 4), two crossing 4 and 12 (at P = 4); every rank runs the vision tower on all
    pixels, and the vision gradients, each rank's for its own tokens, add up over the ranks."""
    per_rank = pool.run("vlm_parity", P, model="step3p7")
    model = hf_step3p7_vlm()
    out = model(**vlm_batch())
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any(n.startswith("model.vision_model") for n in grads)
    _compare("hf-Step3p7ForConditionalGeneration-images-aot_eager", per_rank, out.loss.detach(),
             out.logits.detach(), grads, 16, parity_report)
    rules = [(rec[0], rec[1]) for rec in per_rank[0]["records"]]
    assert ("global_sum", "reductions") in rules and ("masked_scatter_splice", "splice") in rules, rules


def test_a_count_check_that_measures_the_masked_embeddings_sees_the_global_count(pool, parity_report):
    """Inkling2's check, ``inputs_embeds[mask].numel() == features.numel()``, measures a boolean-indexed
    sharded tensor: it is sized by the global count of the mask instead (the check would fail on every rank
    with the local count), and the splice matches one device."""
    per_rank = pool.run("measured_splice_parity", 2)
    model = MeasuredSplice()
    loss, logits = model(**measured_splice_batch())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    _compare("MeasuredSplice-aot_eager", per_rank, loss.detach(), logits.detach(), grads, 16, parity_report)
    rules = [(rec[0], rec[1]) for rec in per_rank[0]["records"]]
    assert ("masked_count", "reductions") in rules and ("masked_scatter_splice", "splice") in rules, rules
