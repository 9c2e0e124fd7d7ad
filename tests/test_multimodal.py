"""Vision-language models: image features every rank computes whole, spliced into its slice of the sequence
from an exclusive scan of the ranks' image-token counts; the model's own count check sees the global count."""

import pytest
import torch
import torch.nn.functional as F

import cp_passes
from cp_passes.layout import Layout
from cp_passes.transports.splice import row_counts, spliced
from family_models import INKLING2_TEXT, KDA_LAYERS, glm5_next_text, inkling2_weights, step3p7_text
from parity import compare
from shared import step_result


IMAGE_TOKEN = 127
"""The image placeholder id of the tiny vision-language models."""


def hf_step3p7_vlm(seed: int = 0):
    """A tiny Step3p7ForConditionalGeneration: the text model of :func:`hf_step3p7` with a vision tower (one
    layer, patch 14) whose 112 x 112 images give 4 tokens each."""
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=56,
                  patch_size=14)
    config = Step3p7Config(text_config=step3p7_text(), vision_config=vision, image_token_id=IMAGE_TOKEN,
                           use_cache=False)
    torch.manual_seed(seed)
    return Step3p7ForConditionalGeneration(config).float()


VLM_IMAGES = [[6], [2, 11]]
"""Where each row's images start (4 tokens each): row 0's crosses position 8 (a rank boundary at P = 2 and
4), row 1's first crosses 4 and its second 12 (boundaries at P = 4)."""


def vlm_batch(seq_len: int = 16, tokens: int = 4, hw: int = 112) -> dict:
    """Token ids with image placeholders at :data:`VLM_IMAGES`, positions, labels (-100 on the images), and
    every image's pixels (row 0's first)."""
    ids = torch.randint(1, 120, (len(VLM_IMAGES), seq_len), generator=torch.Generator().manual_seed(6))
    for row, starts in enumerate(VLM_IMAGES):
        for start in starts:
            ids[row, start:start + tokens] = IMAGE_TOKEN
    labels = torch.where(ids == IMAGE_TOKEN, -100, ids)
    pixels = torch.randn(sum(map(len, VLM_IMAGES)), 3, hw, hw, generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "position_ids": torch.arange(seq_len).expand(len(VLM_IMAGES), seq_len),
            "labels": labels, "pixel_values": pixels}


def hf_inkling2_vlm(seed: int = 0):
    """A tiny Inkling2ForConditionalGeneration: the text model of :func:`hf_inkling2` with a one-layer vision
    tower; an image of grid (1, 2, 2) (28 x 28 pixels a token, channels last) gives 4 tokens."""
    from transformers import Inkling2Config, Inkling2ForConditionalGeneration

    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=14, spatial_merge_size=2,
                  posemb_grid_size=4, projection_hidden_dim=64, text_hidden_size=64)
    config = Inkling2Config(text_config=INKLING2_TEXT, vision_config=vision, image_token_id=IMAGE_TOKEN,
                            use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return inkling2_weights(Inkling2ForConditionalGeneration(config).float())


def inkling2_vlm_batch() -> dict:
    """:func:`vlm_batch`'s ids, positions and labels with Inkling2's pixels: one 28 x 28 x 3 block a token."""
    batch = vlm_batch()
    images = sum(map(len, VLM_IMAGES))
    batch["pixel_values"] = torch.rand(4 * images, 28, 28, 3, generator=torch.Generator().manual_seed(7)) * 2 - 1
    batch["image_grid_thw"] = torch.tensor([[1, 2, 2]] * images)
    return batch


class MeasuredSplice(torch.nn.Module):
    """Image features spliced into token embeddings after Inkling2's count check, which measures the masked
    embeddings (``inputs_embeds[mask].numel() == features.numel()``); one causal attention layer mixes them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(128, 16)
        self.vision = torch.nn.Linear(12, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 128)

    def forward(self, input_ids, pixel_values, labels):
        x = self.embed(input_ids)
        features = self.vision(pixel_values).tanh()
        mask = (input_ids == IMAGE_TOKEN).unsqueeze(-1).expand_as(x)
        torch._check(x[mask].numel() == features.numel())
        x = x.masked_scatter(mask, features)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        logits = self.head(x + h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"), logits


def measured_splice_batch() -> dict:
    batch = vlm_batch()
    batch.pop("position_ids")
    batch["pixel_values"] = torch.randn(4 * sum(map(len, VLM_IMAGES)), 12, generator=torch.Generator().manual_seed(8))
    return batch


def hf_glm5_next_vlm(seed: int = 0):
    """A tiny Glm5NextForConditionalGeneration: one layer of :func:`hf_glm5_next`'s text model (KDA; the family's
    own case runs the rest) with a one-layer vision tower; an image of grid (1, 4, 4) patches (flattened, 1176
    values each) gives 4 tokens after the 2 x 2 merge. Image and video markers take ids above the batches'
    (120..126)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, num_heads=2, patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
                  out_hidden_size=64, intermediate_size=64, projection_intermediate_size=64, image_size=56)
    config = Glm5NextConfig(text_config=glm5_next_text(KDA_LAYERS[:1]), vision_config=vision,
                            image_token_id=IMAGE_TOKEN, video_token_id=126, image_start_token_id=125,
                            image_end_token_id=124, video_start_token_id=123, video_end_token_id=122, use_cache=False)
    torch.manual_seed(seed)
    return Glm5NextForConditionalGeneration(config).float()


def glm5_next_vlm_batch() -> dict:
    """:func:`vlm_batch`'s ids, positions and labels with Glm5Next's flattened patches, 16 an image."""
    batch = vlm_batch()
    images = sum(map(len, VLM_IMAGES))
    batch["pixel_values"] = torch.randn(16 * images, 1176, generator=torch.Generator().manual_seed(7))
    batch["image_grid_thw"] = torch.tensor([[1, 4, 4]] * images)
    return batch


VLM_MODELS = {"step3p7": (hf_step3p7_vlm, vlm_batch, "step5"),
              "inkling2": (hf_inkling2_vlm, inkling2_vlm_batch, "inkling2"),
              "glm5_next": (hf_glm5_next_vlm, glm5_next_vlm_batch, "glm5_next")}
"""Each vision-language model: builder, batch, spec."""


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


VLM_CASES = [("glm5_next", 2), pytest.param("step3p7", 2, marks=pytest.mark.full),
             pytest.param("inkling2", 2, marks=pytest.mark.full), pytest.param("step3p7", 4, marks=pytest.mark.full),
             pytest.param("inkling2", 4, marks=pytest.mark.full), pytest.param("glm5_next", 4, marks=pytest.mark.full)]
"""One VLM in the default run (the cheapest to compile); each family's text model has its own default case."""


@pytest.mark.parametrize("model,P", VLM_CASES)
def test_vision_language_model_with_images_across_ranks_matches_one_device(pool, parity_report, model, P):
    """transformers' Step3p7, Inkling2 and Glm5Next ForConditionalGeneration: three images of 4 tokens, one
    crossing position 8 (a rank boundary at P = 2 and 4), two crossing 4 and 12 (at P = 4). Every rank runs
    the vision tower on all pixels (Inkling2's and Glm5Next's eagerly: sizes from .tolist()), and the vision
    gradients, each rank's for its own tokens, add up over the ranks."""
    per_rank = pool.run(vlm_parity, P, model=model)
    build, batch, _ = VLM_MODELS[model]
    reference = build()
    out = reference(**batch())
    out.loss.backward()
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert any(n.startswith(("model.vision", "model.visual")) for n in grads)
    compare(f"hf-{type(reference).__name__}-images-aot_eager", per_rank, out.loss.detach(), out.logits.detach(),
             grads, 16, parity_report)
    rules = [(rec[0], rec[1]) for rec in per_rank[0]["records"]]
    assert ("masked_scatter_splice", "splice") in rules, rules
    assert (("eager_module", "eager_modules") in rules) == (model != "step3p7"), rules


def test_a_count_check_that_measures_the_masked_embeddings_sees_the_global_count(pool, parity_report):
    """Inkling2's check, ``inputs_embeds[mask].numel() == features.numel()``, measures a boolean-indexed
    sharded tensor: it is sized by the global count of the mask instead (the check would fail on every rank
    with the local count), and the splice matches one device."""
    per_rank = pool.run(measured_splice_parity, 2)
    model = MeasuredSplice()
    loss, logits = model(**measured_splice_batch())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    compare("MeasuredSplice-aot_eager", per_rank, loss.detach(), logits.detach(), grads, 16, parity_report)
    rules = [(rec[0], rec[1]) for rec in per_rank[0]["records"]]
    assert ("masked_count", "reductions") in rules and ("masked_scatter_splice", "splice") in rules, rules


class Tower(torch.nn.Module):
    """Sizes from data (a split by .tolist() lengths) and dropout: what an eager module must reproduce."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(6, 4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, pixels, lengths, scale=1.0):
        parts = self.drop(self.proj(pixels)).split(lengths.tolist())
        return {"pooled": torch.stack([p.mean(0) for p in parts]) * scale, "tokens": torch.cat(parts)}


def test_an_eager_module_computes_what_the_module_does_with_the_same_gradients():
    """Outside cp_passes the op runs the module; its backward runs it again from the forward's random state,
    so dropout draws the same mask and the gradients are the module's own."""
    from cp_passes.eager_modules import install

    pixels, lengths = torch.randn(7, 6, requires_grad=True), torch.tensor([3, 4])
    plain, wrapped = Tower(), Tower()
    install(torch.nn.Sequential(wrapped), ("0",))
    outs = []
    for model in (plain, wrapped):
        torch.manual_seed(1)
        out = model(pixels, lengths, scale=2.0)
        (out["pooled"].pow(2).sum() + out["tokens"].sum()).backward()
        outs.append((out, pixels.grad.clone(), model.proj.weight.grad))
        pixels.grad = None
    (a, ga, wa), (b, gb, wb) = outs
    assert torch.equal(a["pooled"], b["pooled"]) and torch.equal(a["tokens"], b["tokens"])
    assert torch.equal(ga, gb) and torch.equal(wa, wb)


class TiedTower(torch.nn.Module):
    """Two linear maps around a GELU; ``tied``: one weight under two names."""

    def __init__(self, tied: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        if tied:
            self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


@pytest.mark.parametrize("tied,autocast", [(True, False), (False, True)])
def test_an_eager_module_keeps_tied_weights_and_the_forward_s_autocast(tied, autocast):
    """Both names of a tied weight get their share of its gradient; the backward's second run is in bf16
    autocast as the forward was, so the gradients are the autocast module's own. (Tied under autocast, one
    device sums the two uses' gradients in bf16 and the eager module in fp32.)"""
    from cp_passes.eager_modules import install

    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    plain, wrapped = TiedTower(tied), TiedTower(tied)
    install(torch.nn.Sequential(wrapped), ("0",))
    for model in (plain, wrapped):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        out.backward(grad.to(out.dtype))
    assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
    for name, p in plain.named_parameters(remove_duplicate=False):
        assert torch.equal(p.grad, wrapped.get_parameter(name).grad), name


# Tasks the worker pool's ranks run (pool.run(task, P, ...)).


def measured_splice_parity(group) -> dict:
    model = MeasuredSplice()
    compiled = cp_passes.cp_compile(model, None, mesh=group, backend="aot_eager", verbose=False)
    local, layout = cp_passes.shard_batch(measured_splice_batch(), group)
    loss, logits = compiled(**local)
    loss.backward()
    return step_result(model, compiled, loss, logits, layout)


def vlm_parity(group, model: str) -> dict:
    """A vision-language model's training step on this rank's slice of ids, positions and labels and every
    image's pixels; the loss is the model's mean over the labels."""
    build, batch, spec = VLM_MODELS[model]
    model = build()
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend="aot_eager", verbose=False)
    local, layout = cp_passes.shard_batch(batch(), group, spec)
    out = compiled(**local)
    out.loss.backward()
    return step_result(model, compiled, out.loss, out.logits, layout)
