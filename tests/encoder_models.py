"""Bidirectional encoders as transformers ships them (ModernBERT: global layers over every key, local layers over
a two-sided window), and the parity task the worker pool runs for them (``pool.run(encoder_models.parity,
...)``)."""

from __future__ import annotations

import torch

import cp_passes

from shared import param_grads

VOCAB = 128


def modernbert(attention: str = "sdpa"):
    """Three layers: global, local, local (a window of 4: each query sees 2 keys on either side), so that a
    shard of 4 positions reaches across its neighbours."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    config = ModernBertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                              intermediate_size=64, local_attention=4, global_attn_every_n_layers=3, pad_token_id=0,
                              attn_implementation=attention)
    return ModernBertForMaskedLM(config)


def t5(attention: str = "sdpa"):
    """T5's encoder with a token classifier: a bucketed relative-position bias (8 buckets each way, exact up to 4
    positions, logarithmic up to 16: a shard of 4 positions sees keys in every bucket), learned in the first layer
    and added to every layer's scores."""
    from transformers import T5Config, T5ForTokenClassification

    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=64, num_layers=2, num_heads=4, num_labels=VOCAB,
                      relative_attention_num_buckets=16, relative_attention_max_distance=16, dropout_rate=0.0,
                      classifier_dropout=0.0, pad_token_id=0, attn_implementation=attention)
    return T5ForTokenClassification(config)


MODELS = {"modernbert": modernbert, "t5": t5}


def build(attention: str = "sdpa", seed: int = 0, model: str = "modernbert"):
    torch.manual_seed(seed)
    return MODELS[model](attention).float()


def batch(seq_len: int, padded: bool = False) -> dict:
    """Token ids, masked-LM labels at every third position (-100 elsewhere), and with ``padded`` an
    ``attention_mask`` whose second row ends in 3 pad tokens."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (2, seq_len), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    out = {"input_ids": ids, "labels": labels}
    if padded:
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0
        ids[1, -3:] = 0
        labels[1, -3:] = -100
        out["attention_mask"] = mask
    return out


def parity(group, seq_lens: list[int], attention: str = "sdpa", padded: bool = False, layout: str = "auto",
           model: str = "modernbert") -> list:
    """The model compiled with spec=None (``layout`` overriding the default's), one step per length."""
    model = build(attention, model=model)
    spec = None if layout == "auto" else cp_passes.CPSpec(layout=layout)
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend="aot_eager", verbose=False)
    results = []
    for seq_len in seq_lens:
        local, layout_ = cp_passes.shard_batch(batch(seq_len, padded), group, compiled.spec)
        model.zero_grad()
        out = compiled(**local)
        out.loss.backward()
        results.append({"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": param_grads(model),
                        "valid": layout_.valid, "positions": layout_.positions,
                        "records": [(r.rule, r.transport, r.bytes, r.lower_bound_bytes, r.source)
                                    for r in compiled.compile_records[-1].records]})
    return results


def reference(seq_len: int, attention: str = "sdpa", padded: bool = False, model: str = "modernbert"):
    """One device: the output, the gradients and the positions compared: the tokens the attention_mask keeps.
    A pad token's output is not defined: where every key its window reaches is padding (the last pad token's
    local window, under shard_batch's padding as well), eager attention's additive mask spreads it evenly over
    all keys, a number of keys that padding changes."""
    model = build(attention, model=model)
    b = batch(seq_len, padded)
    out = model(**b)
    out.loss.backward()
    return out, param_grads(model), b["attention_mask"].bool() if padded else torch.ones(2, seq_len, dtype=torch.bool)


def fp32_floor(seq_len: int, attention: str = "sdpa", padded: bool = False, model: str = "modernbert") -> float:
    """How far one device's fp32 gradients are from its fp64 ones (relative to each parameter's largest entry, the
    largest over parameters): at 4,096 positions T5's bias table sums 4 x 4,096 x 4,096 terms into 16 buckets."""
    grads = []
    for dtype in (torch.float32, torch.float64):
        m = build(attention, model=model).to(dtype)
        m(**batch(seq_len, padded)).loss.backward()
        grads.append({n: p.grad.double() for n, p in m.named_parameters() if p.grad is not None})
    return max(((grads[0][n] - g).abs().max() / g.abs().max()).item() for n, g in grads[1].items())


class ToyEncoder(torch.nn.Module):
    """Embeddings, one bidirectional attention layer (SDPA, or written by hand) whose mask is built in one of the
    ways encoders build it
    (``variant``), a projection to the vocabulary: the loss is the sum of squares of the logits at every
    position the padding mask keeps."""

    VARIANTS = ("two_sided_band", "doc_ids", "band_and_padding", "band_in_a_helper", "asymmetric_band", "prefix_lm",
                "eager_additive_band", "eager_masked_fill_band", "eager_where_asymmetric", "eager_padding_band")
    ADVERSARIAL = ("band_or_marked",)
    """A band for one document whose data widens it: ``band | (attention_mask == 2)`` (a key marked 2 is seen
    by every query)."""
    """The ``eager_`` ones write attention by hand (``softmax(q @ k^T * scale + mask) @ v``): a band added as
    0 / finfo.min, filled in with ``masked_fill``, picked with ``where`` (one later key, ``window`` earlier), and
    a band added to a padding mask (every key: the padding mask is data)."""

    def __init__(self, variant: str, dim: int = 16, window: int = 3):
        super().__init__()
        self.variant, self.window = variant, window
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, VOCAB)

    def band(self, positions):
        return (positions[:, None] - positions[None, :]).abs() <= self.window

    def forward(self, input_ids, attention_mask=None, doc_ids=None):
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        if self.variant == "two_sided_band":
            mask = (pos[None, :] <= pos[:, None] + self.window) & (pos[None, :] >= pos[:, None] - self.window)
        elif self.variant == "doc_ids":
            mask = (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
        elif self.variant == "band_and_padding":
            mask = self.band(pos)[None, None] & attention_mask.bool()[:, None, None, :]
        elif self.variant == "band_or_marked":
            mask = self.band(pos)[None, None] | (attention_mask == 2)[:, None, None, :]
        elif self.variant == "asymmetric_band":  # window keys before, 1 after, written as a distance
            distance = pos[:, None] - pos[None, :]
            mask = (distance >= -1) & (distance <= self.window)
        elif self.variant == "prefix_lm":  # causal, but the first 6 positions (a prompt) seen by every query
            mask = (pos[None, :] <= pos[:, None]) | (pos[None, :] < 6)
        elif self.variant.startswith("eager_"):
            return self.eager(input_ids, q, k, v, pos, attention_mask)
        else:
            mask = self.band(pos)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(y, input_ids, attention_mask)

    def eager(self, input_ids, q, k, v, pos, attention_mask):
        scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        low = torch.finfo(scores.dtype).min
        if self.variant == "eager_additive_band":
            scores = scores + torch.zeros(pos.shape[0], pos.shape[0]).masked_fill(~self.band(pos), low)
        elif self.variant == "eager_masked_fill_band":
            scores = scores.masked_fill(~self.band(pos), low)
        elif self.variant == "eager_where_asymmetric":
            distance = pos[:, None] - pos[None, :]
            scores = torch.where((distance >= -1) & (distance <= self.window), scores, low)
        else:
            keep = self.band(pos)[None, None] & attention_mask.bool()[:, None, None, :]
            scores = scores + (~keep).float() * low
        y = scores.softmax(-1) @ v
        return self.head(y, input_ids, attention_mask)

    def head(self, y, input_ids, attention_mask):
        logits = self.out(y.transpose(1, 2).flatten(-2))
        keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        return logits, (logits.pow(2).sum(-1) * keep).sum()


def toy_batch(variant: str, seq_len: int) -> dict:
    """Token ids; a padding mask (the second row's last 3 tokens) or doc ids (documents of 5, 7 and the rest)."""
    ids = torch.randint(1, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(9))
    if variant == "doc_ids":
        docs = torch.tensor([0] * 5 + [1] * 7 + [2] * (seq_len - 12))
        return {"input_ids": ids, "doc_ids": docs.expand(2, seq_len).clone()}
    if variant == "band_or_marked":
        mask = torch.ones_like(ids)
        mask[0, 1] = 2
        return {"input_ids": ids, "attention_mask": mask}
    if variant in ("band_and_padding", "eager_padding_band"):
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0
        return {"input_ids": ids, "attention_mask": mask}
    return {"input_ids": ids}


def toy_parity(group, variant: str, seq_len: int, window: int = 3) -> dict:
    torch.manual_seed(0)
    model = ToyEncoder(variant, window=window)
    compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
    local, layout = cp_passes.shard_batch(toy_batch(variant, seq_len), group)
    logits, loss = compiled(**local)
    loss.backward()
    records = compiled.compile_records[-1].records
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": param_grads(model),
            "positions": layout.positions, "rules": [r.rule for r in records if r.rule.startswith(("sdpa", "key_"))],
            "halo": any(r.rule == "key_operand" and "a halo of" in r.note for r in records)}


def toy_error(group, variant: str, seq_len: int) -> str:
    """The error of one step (or "no error")."""
    torch.manual_seed(0)
    compiled = cp_passes.cp_compile(ToyEncoder(variant), mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(toy_batch(variant, seq_len), group)
    try:
        compiled(**local)[1].backward()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def toy_reference(variant: str, seq_len: int, window: int = 3):
    torch.manual_seed(0)
    model = ToyEncoder(variant, window=window)
    batch = toy_batch(variant, seq_len)
    logits, loss = model(**batch)
    loss.backward()
    return logits, loss, param_grads(model), batch.get("attention_mask", torch.ones(2, seq_len)).bool()
