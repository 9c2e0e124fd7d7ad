"""Mixture-of-experts models as transformers ships them (the default experts implementation, grouped_mm, on
its CPU fallback here), and the parity task the worker pool runs for them (``pool.run(moe_models.parity,
...)``)."""

from __future__ import annotations

import torch

import cp_passes
from family_models import hf_one_device
from shared import packed_batch, packed_model_inputs, param_grads, toy_batch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, use_cache=False, pad_token_id=0, eos_token_id=None,
            bos_token_id=None)


def olmoe(aux: bool):
    from transformers import OlmoeConfig, OlmoeForCausalLM

    return OlmoeForCausalLM(OlmoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, output_router_logits=aux,
                                        router_aux_loss_coef=0.1))


def mixtral(aux: bool):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2,
                                            output_router_logits=aux, router_aux_loss_coef=0.1))


def gpt_oss(aux: bool):
    """Biases inside the experts (added in place after each grouped matmul), attention sinks, sliding-window
    layers (a window of 4) alternating with full ones."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=4,
                          output_router_logits=aux, router_aux_loss_coef=0.1)
    model = GptOssForCausalLM(config)
    with torch.no_grad():  # transformers initialises the sinks and expert biases to zero: they would test nothing
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "_bias")):
                p.normal_(0, 0.5)
    return model


def qwen2_moe(aux: bool):
    """Routed experts and a shared expert behind a sigmoid gate; the config builds a sliding mask of width 0 that no
    layer reads (``sliding_window=0``, every layer full attention)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**TINY, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                              num_experts=4, num_experts_per_tok=2, output_router_logits=aux,
                                              router_aux_loss_coef=0.1))


def llama4(aux: bool):
    """Llama 4's text model: complex RoPE (``polar``, ``view_as_complex``), chunked attention (chunks of 8: a query
    sees the earlier keys of its chunk) in three layers of four, the fourth without RoPE over every earlier key, and
    MoE layers that repeat every token once per expert (``x.repeat(E, 1)``) beside a shared expert."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = {**TINY, "num_hidden_layers": 4}
    return Llama4ForCausalLM(Llama4TextConfig(**config, head_dim=16, intermediate_size_mlp=64, num_local_experts=4,
                                              num_experts_per_tok=1, attention_chunk_size=8,
                                              no_rope_layers=[1, 1, 1, 0], moe_layers=[1, 3],
                                              output_router_logits=aux, router_aux_loss_coef=0.1))


FAMILIES = {"olmoe": olmoe, "mixtral": mixtral, "gpt_oss": gpt_oss, "qwen2_moe": qwen2_moe, "llama4": llama4}
OWN_EXPERTS = ("llama4",)
"""Families whose experts are their own code (Llama 4's batched matmul), not transformers' grouped_mm."""


def build(family: str, aux: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    model = FAMILIES[family](aux).float()
    assert family in OWN_EXPERTS or model.config._experts_implementation == "grouped_mm", \
        model.config._experts_implementation
    return model


def batch(seq_len: int, documents: list[list[int]] | None = None) -> dict:
    """``labels=input_ids`` (the model shifts them), or packed rows of ``documents`` (lengths per row) with
    positions restarting at each document and labels shifted inside each."""
    if documents:
        layout = [[(n, n) for n in row] for row in documents]
        return packed_batch(sum(documents[0]), layout, 128)
    b = toy_batch(seq_len, 2, vocab=128, seed=2)
    return {"input_ids": b["input_ids"], "position_ids": b["position_ids"], "labels": b["input_ids"].clone()}


def _inputs(global_or_local: dict, packed: bool) -> dict:
    return packed_model_inputs(global_or_local, hf=True) if packed else global_or_local


def parity(group, family: str, seq_lens: list[int], aux: bool = False, documents: list | None = None) -> list[dict]:
    """The model compiled with the default spec, one forward/backward per length (or one packed batch)."""
    model = build(family, aux)
    compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
    results = []
    for seq_len in seq_lens:
        local, layout = cp_passes.shard_batch(batch(seq_len, documents), group)
        model.zero_grad()
        out = compiled(**_inputs(local, bool(documents)))
        out.loss.backward()
        results.append({"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": param_grads(model),
                        "aux_loss": out.aux_loss.detach() if aux else None, "valid": layout.valid,
                        "positions": layout.positions,
                        "records": [(r.rule, r.transport, r.bytes, r.source)
                                    for r in compiled.compile_records[-1].records]})
    return results


def reference(family: str, seq_len: int, aux: bool = False, documents: list | None = None):
    """One device: the output, the gradients and which positions are real (all, or the packed documents')."""
    return hf_one_device(build(family, aux), batch(seq_len, documents), seq_len, bool(documents))


class HandMoE(torch.nn.Module):
    """Token embeddings, a top-2 router over 4 experts and experts written by hand in one of the ways models
    dispatch tokens (``variant``), then a projection to the vocabulary."""

    VARIANTS = ("argsort_index_add", "sort_index_put", "argsort_of_perm", "index_select_scatter_back",
                "fallback_grouped_mm", "boolean_selection", "repeat_per_expert")

    def __init__(self, variant: str, experts: int = 4, k: int = 2, dim: int = 16):
        super().__init__()
        self.variant, self.k = variant, k
        self.embed = torch.nn.Embedding(64, dim)
        self.router = torch.nn.Linear(dim, experts)
        self.w = torch.nn.Parameter(torch.randn(experts, dim, dim) / dim ** 0.5)
        self.out = torch.nn.Linear(dim, 64)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        b, s, d = h.shape
        x = h.reshape(-1, d)
        weights, ids = self.router(x).softmax(-1).topk(self.k, -1)
        return self.out(h + self.dispatch(x, ids.reshape(-1), weights.reshape(-1)).view(b, s, d))

    def dispatch(self, x, ids, weights):
        k, variant = self.k, self.variant
        if variant == "argsort_index_add":  # Mixtral-style put back: sum each token's k rows by index_add
            perm = ids.argsort(stable=True)
            rows = torch.bmm(x[perm // k].unsqueeze(1), self.w[ids[perm]]).squeeze(1) * weights[perm, None]
            return torch.zeros_like(x).index_add_(0, perm // k, rows)
        if variant == "sort_index_put":  # values and indices of one sort; rows written back through the indices
            keys, perm = torch.sort(ids)
            rows = torch.bmm(x.repeat_interleave(k, 0)[perm].unsqueeze(1), self.w[keys]).squeeze(1)
            back = torch.zeros(x.shape[0] * k, x.shape[1])
            back[perm] = rows * weights[perm, None]
            return back.view(-1, k, x.shape[1]).sum(1)
        if variant == "argsort_of_perm":  # the inverse as argsort(perm), read back by gathering
            perm = torch.argsort(ids)
            rows = torch.bmm(x[perm // k].unsqueeze(1), self.w[ids[perm]]).squeeze(1) * weights[perm, None]
            return rows[perm.argsort()].view(-1, k, x.shape[1]).sum(1)
        if variant == "index_select_scatter_back":
            perm = ids.sort(descending=True).indices
            rows = torch.bmm(x.index_select(0, perm // k).unsqueeze(1), self.w.index_select(0, ids[perm]))
            rows = rows.squeeze(1) * weights.index_select(0, perm).unsqueeze(-1)
            return torch.zeros_like(x).index_add(0, perm // k, rows)
        if variant in ("repeat_per_expert", "repeat_split_inner"):  # Llama 4: every token once per expert
            experts = self.w.shape[0]
            scores = torch.zeros(x.shape[0], experts).scatter(1, ids.view(-1, k), weights.view(-1, k))
            routed = x.repeat(experts, 1) * scores.transpose(0, 1).reshape(-1, 1)
            if variant == "repeat_split_inner":  # [tokens, E, d]: each token's copies read as neighbours (wrong)
                return routed.view(-1, experts, x.shape[1]).sum(1)
            return torch.bmm(routed.view(experts, -1, x.shape[1]), self.w).sum(0)
        if variant == "boolean_selection":  # a loop over the experts: each one's (token, slot) pairs by a mask
            pairs, out = x.repeat_interleave(k, 0), torch.zeros(x.shape[0] * k, x.shape[1])
            for e in range(self.w.shape[0]):
                mask = ids == e
                out[mask] = (pairs[mask] @ self.w[e]).relu() * weights[mask].unsqueeze(-1)
            return out.view(-1, k, x.shape[1]).sum(1)
        keys, perm = torch.sort(ids)  # transformers' own steps: histc counts, offsets, its grouped matmul
        counts = torch.histc(keys.float(), bins=self.w.shape[0], min=0, max=self.w.shape[0] - 1)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = torch.ops.transformers.grouped_mm_fallback(x[perm // k], self.w, offs=offsets) * weights[perm, None]
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        return rows[inverse].view(-1, k, x.shape[1]).sum(1)


def hand_moe_parity(group, seq_len: int) -> dict:
    """Every :class:`HandMoE` variant compiled and run on one batch; this rank's results per variant."""
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    results = {}
    for variant in HandMoE.VARIANTS:
        torch.manual_seed(0)
        model = HandMoE(variant)
        compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
        local, layout = cp_passes.shard_batch({"input_ids": toy_batch(seq_len, 2, vocab=64)["input_ids"]}, group)
        out = compiled(local["input_ids"])
        (out.square() * layout.valid[..., None]).sum().backward()  # the padding's rows are no one's loss
        results[variant] = {"logits": out.detach(), "grads": param_grads(model), "positions": layout.positions}
    return results


GLM5_SHARED = dict(layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
                   indexer_types=["full", "full", "shared"], mlp_layer_types=["dense", "sparse", "sparse"])
"""A Glm5Next mix as the family ships it: a KDA layer, an indexed-attention layer with its own (full) indexer
and one that reuses its top-k (shared), MoE after a dense first layer."""


def glm5_next(kpool: int, seed: int = 0):
    from transformers import Glm5NextTextConfig, Glm5NextTextModel

    from family_models import glm5_next_text

    config = {**glm5_next_text(tuple(GLM5_SHARED["layer_types"])), **GLM5_SHARED, "index_kpool": kpool,
              "index_topk": 2 * kpool}
    torch.manual_seed(seed)
    return Glm5NextTextModel(Glm5NextTextConfig(**config)).float()


def glm5_next_parity(group, kpool: int, seq_len: int) -> dict:
    """The model with model_specs/glm5_next.py; the loss is the sum of squares of the last hidden states."""
    from family_models import glm5_next_batch

    model = glm5_next(kpool)
    compiled = cp_passes.cp_compile(model, "glm5_next", mesh=group, backend="aot_eager", verbose=False)
    local, layout = cp_passes.shard_batch(glm5_next_batch(seq_len), group, "glm5_next")
    out = compiled(**local).last_hidden_state
    loss = out.pow(2).sum()
    loss.backward()
    return {"loss": loss.detach(), "logits": out.detach(), "grads": param_grads(model), "valid": layout.valid,
            "positions": layout.positions}


def deepseek_v4(aux: bool = True):
    """The DeepSeek V4 test model (routed and hash-routed MoE on grouped_mm) with its router loss on."""
    from family_models import hf_deepseek_v4

    model = hf_deepseek_v4()
    model.config.output_router_logits = aux
    return model


def deepseek_v4_aux_parity(group, seq_len: int) -> dict:
    """model(input_ids, position_ids, labels=shift_labels, shift_labels=...): the loss with the router's."""
    from family_models import deepseek_v4_batch

    model = deepseek_v4()
    compiled = cp_passes.cp_compile(model, "deepseek_v4", mesh=group, backend="aot_eager", verbose=False)
    local, layout = cp_passes.shard_batch(deepseek_v4_batch(seq_len=seq_len), group, compiled.spec)
    out = compiled(**local, labels=local["shift_labels"])
    out.loss.backward()
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": param_grads(model),
            "aux_loss": out.aux_loss.detach(), "valid": layout.valid, "positions": layout.positions}
