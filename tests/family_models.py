"""transformers models, configs and batches that several test modules build: tiny configs of the families the
suite runs (a model one module alone builds lives in that module)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import cp_passes
from cp_passes.spec import resolve_spec
from shared import packed_model_inputs, param_grads, step_result, toy_batch


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


def hf_gemma2(seed: int = 0):
    """A tiny Gemma2 with attention written by hand (eager): soft-capped scores, sliding-window layers (a
    window of 4, longer than a shard at P = 4) alternating with global ones, masks from position_ids."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                          sliding_window=4, attn_implementation="eager", use_cache=False)
    torch.manual_seed(seed)
    return Gemma2ForCausalLM(config).float()


def hf_inkling2(seed: int = 0, heads: int | None = None):
    """A tiny Inkling2 text model, both layer types: eager attention with a relative-position bias from the
    queries' activations (extent 6, longer than a shard at P = 4), sinks concatenated on the key axis,
    log-scaled queries from position_ids, a short conv (sliding layers, window 4) and a dynamic one written
    with pad + unfold (full layers); MoE experts on transformers' default grouped_mm. ``heads``: query heads of
    both layer types over one key/value head, fewer at 16k positions, where eager attention materializes its
    [heads, S, S] scores."""
    from transformers import Inkling2ForCausalLM, Inkling2TextConfig

    text = INKLING2_TEXT if heads is None else {
        **INKLING2_TEXT, "num_attention_heads": heads, "num_key_value_heads": 1, "swa_num_attention_heads": heads,
        "swa_num_key_value_heads": 1}
    config = Inkling2TextConfig(**text, attn_implementation="eager")
    torch.manual_seed(seed)
    return inkling2_weights(Inkling2ForCausalLM(config).float())


INKLING2_TEXT = dict(
    vocab_size=128, unpadded_vocab_size=128, eos_token_id=None, hidden_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
    swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=4, d_rel=8, rel_extent=6,
    log_scaling_n_floor=4, layer_types=["hybrid_sliding", "hybrid"], conv_kernel_size=3,
    moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=1,
    use_cache=False)


def inkling2_weights(model):
    """Constant parameters (unit scales, zero queries) and std-0.02 weights would hide errors (near-uniform
    attention, no rel-pos profile): weights are drawn at 1 / sqrt(fan_in), which keeps activations O(1), and
    vectors perturbed. Larger weights make the model amplify rounding: computing the same positions with more
    masked keys then changes its own logits by more than the parity tolerance on one device."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
            else:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def hf_mistral_window(seed: int = 0):
    """A tiny Mistral with transformers' sliding-window mask of 4,096 keys (a window only lengths past it show),
    its cache off (a sliding-window cache slices the sequence: cp_passes asks for use_cache=False)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            sliding_window=4096, attn_implementation="sdpa", use_cache=False)).float()


PHI3_ORIGINAL_LENGTH = 64
"""The tiny Phi-3's ``original_max_position_embeddings``: longrope's long factors past it, short ones up to it."""


def hf_phi3_longrope(seed: int = 0):
    """A tiny Phi-3 with longrope (Phi-3/3.5/4-mini's long-context RoPE): its factors switch on
    ``torch.max(position_ids) + 1 > original_max_position_embeddings``, a max over the whole sequence."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    half = 8
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 10 for i in range(half)],
            "long_factor": [2.0 + i for i in range(half)], "original_max_position_embeddings": PHI3_ORIGINAL_LENGTH,
            "factor": 1024 / PHI3_ORIGINAL_LENGTH}
    return Phi3ForCausalLM(Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      original_max_position_embeddings=PHI3_ORIGINAL_LENGTH, rope_parameters=rope,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
                                      use_cache=False)).float()


def hf_qwen3(seed: int = 0):
    """A tiny Qwen3 (Llama's layout with per-head q/k RMSNorm), causal SDPA, its cache off."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        attn_implementation="sdpa", use_cache=False)).float()


def hf_deepseek_v3(seed: int = 0, heads: int = 8):
    """A tiny DeepSeek-V3 as transformers ships it: multi-head latent attention (K and V of 8 heads x (16 + 8 + 16)
    decompressed from a latent of kv_lora_rank 32 + qk_rope_head_dim 8 a position, RoPE on the rope part,
    interleaved), a dense layer, then a routed MoE layer with a shared expert, its cache off. ``heads``: fewer at
    16k positions, where one device's attention materializes its [heads, S, S] scores."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=32, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, attn_implementation="sdpa", use_cache=False)).float()


HF_MODELS = {"llama": hf_llama, "gemma2": hf_gemma2, "inkling2": hf_inkling2, "mistral-window": hf_mistral_window,
             "phi3-longrope": hf_phi3_longrope, "qwen3": hf_qwen3, "deepseek-v3": hf_deepseek_v3,
             "deepseek-v3-2-heads": lambda seed=0: hf_deepseek_v3(seed, heads=2),
             "inkling2-1-head": lambda seed=0: hf_inkling2(seed, heads=1)}


def hf_batch(seq_len: int, batch: int = 2, seed: int = 2, labels_in_model: bool = False,
             position_ids: bool = True) -> dict:
    """Inputs for LlamaForCausalLM: pre-shifted labels (passed as labels= and shift_labels=), or, with
    ``labels_in_model``, unshifted labels (``labels=input_ids``) that the model shifts itself; without
    ``position_ids``, the model counts positions itself."""
    b = toy_batch(seq_len, batch, vocab=128, seed=seed)
    positions = {"position_ids": b["position_ids"]} if position_ids else {}
    if labels_in_model:
        return {"input_ids": b["input_ids"], **positions, "labels": b["input_ids"].clone()}
    return {"input_ids": b["input_ids"], **positions, "shift_labels": b["labels"]}


def hf_parity(group, backend: str, seq_lens: list[int], mean_loss: bool = False,
              labels_in_model: bool = False, family: str = "llama", checkpointing: bool = False,
              spec: dict | None = None, position_ids: bool = True, batch: int = 2) -> list[dict]:
    """LlamaForCausalLM with position_ids and pre-shifted labels. The loss is sum / global token count, given
    as num_items_in_batch, or (mean_loss) the model's own mean, which cp_passes makes global. With
    ``labels_in_model`` it is called as users do, ``model(input_ids, labels=input_ids)``, and shifts inside.
    ``checkpointing``: transformers' activation checkpointing on every decoder layer (called with use_cache=False,
    as cp_passes asks: the layers would log while turning the configured cache off). ``spec``: CPSpec fields
    replaced in the spec the model's type picks."""
    model = HF_MODELS[family]()
    call = {}
    if checkpointing:
        model.activation_checkpointing_enable()
        call["use_cache"] = False
    chosen = {} if spec is None else {"spec": dataclasses.replace(resolve_spec(None, model.config), **spec)}
    compiled = cp_passes.cp_compile(model, mesh=group, backend=backend, verbose=False, **chosen)
    results = []
    for seq_len in seq_lens:
        global_batch = hf_batch(seq_len, batch, labels_in_model=labels_in_model, position_ids=position_ids)
        local, layout = cp_passes.shard_batch(global_batch, group, compiled.spec)
        model.zero_grad()
        if labels_in_model:
            out = compiled(**local, **call)
        else:
            count = (global_batch["shift_labels"] != -100).sum()
            extra = {} if mean_loss else {"num_items_in_batch": count}
            out = compiled(**local, labels=local["shift_labels"], **extra, **call)
        out.loss.backward()
        results.append({"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": param_grads(model),
                        "valid": layout.valid, "positions": layout.positions, "compiles": len(compiled.compile_records),
                        "records": [(r.rule, r.transport, r.bytes, r.lower_bound_bytes)
                                    for r in compiled.compile_records[-1].records]})
    return results


def hf_one_device(model, batch: dict, seq_len: int, packed: bool) -> tuple:
    """A transformers model on one device: its output, its gradients and which positions are real (all, or the
    documents of a ``packed`` batch, which is packed here as shard_batch would)."""
    from cp_passes.data.checks import check_batch
    from cp_passes.data.packing import pack

    if packed:
        batch = pack(check_batch(batch, cp_passes.CPSpec(), ()))
    out = model(**(packed_model_inputs(batch, hf=True) if packed else batch))
    out.loss.backward()
    return out, param_grads(model), batch["valid"] if packed else torch.ones(2, seq_len, dtype=torch.bool)


KDA_LAYERS = ("linear_attention",) * 3
"""Glm5Next's first three layer types: Kimi Delta Attention."""


def glm5_next_text(layer_types: tuple[str, ...] = KDA_LAYERS) -> dict:
    n = len(layer_types)
    return dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=n,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_kpool=4,
        index_head_dim=16, index_n_heads=2, linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=4,
        hc_mult=2, hc_sinkhorn_iters=3, pad_token_id=0, use_cache=False, layer_types=list(layer_types),
        mlp_layer_types=["dense"] + ["sparse"] * (n - 1), indexer_types=["full"] * n)


def glm5_next_batch(seq_len: int) -> dict:
    ids = torch.randint(1, 128, (2, seq_len), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "position_ids": torch.arange(seq_len).expand(2, seq_len)}


def hf_deepseek_v4(seed: int = 0, layers: int = 3):
    """A tiny DeepseekV4ForCausalLM: a sliding-window layer (window 12, longer than the tests' shards of 8), a
    compressed-sparse-attention layer (CSA: windows of 2 paired with the previous one, a top-2 indexer) and a
    heavily-compressed one (HCA: windows of 4), attention sinks, hyper-connections, a hash-routed MoE layer
    and two routed ones (experts on transformers' default grouped_mm). Every layer's raw keys go by a halo of 11 rows.
    ``layers`` (a multiple of 3) repeats the three."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, head_dim=32, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, hc_mult=2, hc_sinkhorn_iters=3, sliding_window=12, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, index_topk=2,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"] * (layers // 3),
        mlp_layer_types=["hash_moe", "moe", "moe"] * (layers // 3), use_cache=False, pad_token_id=0,
        num_nextn_predict_layers=0)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).float()
    with torch.no_grad():  # a hash table that routes tokens to different experts
        for layer in model.model.layers:
            if hasattr(layer.mlp.gate, "tid2eid"):
                layer.mlp.gate.tid2eid.copy_(torch.randint(0, 4, layer.mlp.gate.tid2eid.shape,
                                                           generator=torch.Generator().manual_seed(seed)))
    return model


def deepseek_v4_batch(documents: list[list[int]] | None = None, seq_len: int = 16, rows: int = 2) -> dict:
    """Token ids with positions and labels shifted before sharding (``rows`` of them), or packed rows (one list of
    document lengths per row) with unshifted labels, which shard_batch shifts inside each document."""
    rows = len(documents) if documents else rows
    length = sum(documents[0]) if documents else seq_len
    ids = torch.randint(1, 128, (rows, length), generator=torch.Generator().manual_seed(2))
    if documents:
        return {"input_ids": ids, "labels": ids.clone(), "seq_lens": torch.tensor(documents)}
    shifted = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], 1)
    return {"input_ids": ids, "position_ids": torch.arange(length).expand(rows, length), "shift_labels": shifted}


def deepseek_v4_parity(group, documents: list[list[int]] | None = None, seq_len: int = 16,
                       positions: bool = True, regions: bool = False, rows: int = 2) -> dict:
    """DeepseekV4ForCausalLM with its family spec, on a batch sharded by shard_batch (packed rows become a
    doc-id map, per-document positions and labels), called with or without ``position_ids``, its layers nested
    compile regions or not: this rank's results (a task the worker pool runs)."""
    model = hf_deepseek_v4(layers=6 if regions else 3)
    compiled = cp_passes.cp_compile(model, "deepseek_v4", mesh=group, backend="aot_eager", verbose=False,
                                    regions=regions)
    assert compiled.spec.pad_multiple == 4  # read from the config's rates
    local, layout = cp_passes.shard_batch(deepseek_v4_batch(documents, seq_len, rows), group, compiled.spec)
    loss, logits = deepseek_v4_loss(compiled, local, positions)
    loss.backward()
    return {**step_result(model, compiled, loss, logits, layout),
            "history": [label for label, _ in compiled.compile_records[-1].history]}


STEP3P7_LAYERS = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")


def step3p7_text(moe: bool = True) -> dict:
    return dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=list(STEP3P7_LAYERS),
        mlp_layer_types=["dense"] + ["sparse" if moe else "dense"] * 3, sliding_window=4, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, share_expert_dim=32, max_position_embeddings=64,
        pad_token_id=0, use_cache=False)


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


def step3p7_parity(group, documents: list[list[int]] | None = None, seq_len: int = 16) -> dict:
    """Step3p7TextModel with model_specs/step5.py on a batch sharded by shard_batch; the loss is the sum of
    squares of the last hidden states (a task the worker pool runs)."""
    model = hf_step3p7()
    compiled = cp_passes.cp_compile(model, "step5", mesh=group, backend="aot_eager", verbose=False)
    local, layout = cp_passes.shard_batch(step3p7_batch(documents, seq_len), group, "step5")
    out = compiled(input_ids=local["input_ids"], position_ids=local["position_ids"]).last_hidden_state
    loss = out.pow(2).sum()
    loss.backward()
    return step_result(model, compiled, loss, out, layout)


def hf_glm5_next(seed: int = 0, layer_types: tuple[str, ...] = KDA_LAYERS):
    """A tiny Glm5Next text model (GLM-5.3-Flash's public relative): linear-attention (KDA) layers (short
    causal convs, the KDA recurrence) and indexed-attention layers (MLA over the keys a top-k indexer picks
    from pools of 4, plus the open pool's tail: 11 of the causal keys at most), hyper-connections, a dense MLP
    first and MoE layers after it (4 experts, top 2, transformers' default grouped_mm)."""
    from transformers import Glm5NextTextConfig, Glm5NextTextModel

    config = Glm5NextTextConfig(**glm5_next_text(layer_types))
    torch.manual_seed(seed)
    return Glm5NextTextModel(config).float()


def deepseek_v4_spec() -> cp_passes.CPSpec:
    """model_specs/deepseek_v4.py read for the tiny config's rates (windows of 2 and 4: whole windows of 4)."""
    return cp_passes.load_spec("deepseek_v4", config=hf_deepseek_v4().config)


def deepseek_v4_loss(model, batch: dict, positions: bool = True):
    """The summed cross entropy of the model's logits against labels shifted inside each document; without
    ``positions`` the model numbers the tokens itself (``arange``, shared by its rotary and its masks)."""
    out = model(input_ids=batch["input_ids"], **({"position_ids": batch["position_ids"]} if positions else {}))
    return F.cross_entropy(out.logits.flatten(0, 1), batch["shift_labels"].flatten(), reduction="sum"), out.logits


GLM5_LAYERS = KDA_LAYERS + ("indexed_attention",)
"""Its default pattern's first four: the fourth runs MLA over the keys a top-k indexer picks."""


def glm5_next_parity(group, seq_lens: list[int], layer_types: tuple[str, ...] = KDA_LAYERS) -> list[dict]:
    """The model with model_specs/glm5_next.py; the loss is the sum of squares of the last hidden states (a task
    the worker pool runs)."""
    model = hf_glm5_next(layer_types=tuple(layer_types))
    compiled = cp_passes.cp_compile(model, "glm5_next", mesh=group, backend="aot_eager", verbose=False)
    results = []
    for seq_len in seq_lens:
        local, layout = cp_passes.shard_batch(glm5_next_batch(seq_len), group, "glm5_next")
        model.zero_grad()
        out = compiled(**local).last_hidden_state
        loss = out.pow(2).sum()
        loss.backward()
        results.append(step_result(model, compiled, loss, out, layout))
    return results
