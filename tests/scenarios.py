"""What each rank runs in the multi-process tests (see workers.py). Each returns local tensors;
the tests compare them with the single-device model in the main process."""

from __future__ import annotations

import torch

import cp_passes
from cp_passes.models import ToyLlama, ToyLlamaConfig


def toy_batch(seq_len: int, batch: int = 2, vocab: int = 256, seed: int = 1) -> dict:
    """A global batch: token ids, positions, and labels shifted before sharding (-100 at the end)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
    return {"input_ids": ids, "position_ids": torch.arange(seq_len).expand(batch, seq_len).clone(), "labels": labels}


def toy_model(seed: int = 0, **config) -> ToyLlama:
    torch.manual_seed(seed)
    return ToyLlama(ToyLlamaConfig(**config))


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def toy_parity(group, backend: str, config: dict, seq_lens: list[int], pass_positions: bool,
               spec: dict | None = None) -> list[dict]:
    """One compiled toy model, one forward/backward per global length."""
    model = toy_model(**config)
    spec = cp_passes.CPSpec(**spec) if spec else None
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend=backend, verbose=False)
    results = []
    for seq_len in seq_lens:
        local, layout = cp_passes.shard_batch(toy_batch(seq_len), group)
        if not pass_positions:
            local.pop("position_ids")
        model.zero_grad()
        loss, logits = compiled(**local)
        loss.backward()
        results.append({"loss": loss.detach(), "logits": logits.detach(), "grads": _grads(model),
                        "valid": layout.valid, "start": layout.start, "compiles": len(compiled.compile_records),
                        "records": [(r.rule, r.transport, r.bytes, r.lower_bound_bytes)
                                    for r in compiled.compile_records[-1].records]})
    return results


def hf_llama_config(use_cache: bool = True):
    """A tiny Llama. With use_cache=False transformers 5.x builds a packed-sequence mask from
    position_ids under torch.compile, which cp_passes refuses until packed documents land."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       attn_implementation="sdpa", use_cache=use_cache)


def hf_llama(seed: int = 0, use_cache: bool = True):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(hf_llama_config(use_cache)).float()


def hf_batch(seq_len: int, batch: int = 2, seed: int = 2) -> dict:
    b = toy_batch(seq_len, batch, vocab=128, seed=seed)
    return {"input_ids": b["input_ids"], "position_ids": b["position_ids"], "shift_labels": b["labels"]}


def hf_parity(group, backend: str, seq_lens: list[int], mean_loss: bool = False) -> list[dict]:
    """LlamaForCausalLM with position_ids and pre-shifted labels. The loss is sum / global token count, given
    as num_items_in_batch, or (mean_loss) the model's own mean, which cp_passes makes global."""
    model = hf_llama()
    compiled = cp_passes.cp_compile(model, mesh=group, backend=backend, verbose=False)
    results = []
    for seq_len in seq_lens:
        global_batch = hf_batch(seq_len)
        count = (global_batch["shift_labels"] != -100).sum()
        local, layout = cp_passes.shard_batch(global_batch, group)
        model.zero_grad()
        extra = {} if mean_loss else {"num_items_in_batch": count}
        out = compiled(**local, labels=local["shift_labels"], **extra)
        out.loss.backward()
        results.append({"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": _grads(model),
                        "valid": layout.valid, "compiles": len(compiled.compile_records)})
    return results


def gather_roundtrip(group, seq_len: int) -> dict:
    """shard_batch then gather_sequence gives back the global tensor; gradients reach their owners."""
    global_batch = toy_batch(seq_len)
    local, layout = cp_passes.shard_batch(global_batch, group)
    x = local["input_ids"].float().requires_grad_()
    full = cp_passes.gather_sequence(x, group, layout=layout)
    (full * torch.arange(1, seq_len + 1)).sum().backward()
    return {"full": full.detach(), "grad": x.grad, "layout": (layout.seq_len, layout.padded_len, layout.slices),
            "local": local}


def halo_roundtrip(group, seq_len: int, halo: int, left_padding: int) -> dict:
    """gather_halo against slicing the global tensor; gradients go back to the owners."""
    x_global = torch.arange(2 * seq_len * 3, dtype=torch.float32).view(2, seq_len, 3)
    local, _ = cp_passes.shard_batch({"x": x_global}, group, cp_passes.CPSpec(seq_inputs=("x",)))
    x = local["x"].requires_grad_()
    out = cp_passes.gather_halo(x, group, halo, dim=1, left_padding=left_padding)
    (out * torch.arange(out.shape[1], dtype=torch.float32)[None, :, None]).sum().backward()
    return {"out": out.detach(), "grad": x.grad}
