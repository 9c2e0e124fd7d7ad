"""State-space and linear-attention hybrids as transformers ships them (Mamba-2's chunked scan, the gated delta
rule, Kimi Delta Attention), BLOOM's and MPT's ALiBi, and learned position tables sliced to the sequence length,
compiled with spec=None: the shipped spec, if any, is picked by the config's model_type. The parity task the
worker pool runs for them is ``pool.run(hybrid_models.parity, ...)``."""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutput

import cp_passes

from family_models import hf_one_device
from shared import packed_batch, packed_model_inputs, param_grads, toy_batch

TINY = dict(vocab_size=128, hidden_size=64, pad_token_id=0, eos_token_id=None, bos_token_id=None, use_cache=False)
ATTENTION = dict(num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=4,
             mamba_d_conv=4, mamba_expand=1)
"""A chunk of 4 positions: a shard of 8 holds two chunks, and an odd length a partial one."""


def mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM

    return Mamba2ForCausalLM(Mamba2Config(**TINY, num_hidden_layers=2, num_heads=4, head_dim=32, state_size=8,
                                          n_groups=2, chunk_size=4, expand=2))


def bamba():
    """A Mamba-2 layer, then an attention layer."""
    from transformers import BambaConfig, BambaForCausalLM

    return BambaForCausalLM(BambaConfig(**TINY, **ATTENTION, **MAMBA, num_hidden_layers=2, attn_layer_indices=[1]))


def qwen3_next():
    """A gated-DeltaNet layer, then a gated full-attention layer; MoE MLPs on grouped_mm."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM(Qwen3NextConfig(
        **TINY, **ATTENTION, head_dim=16, num_hidden_layers=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"]))


def nemotron_h():
    """Mamba-2, attention, MLP layers (NemotronH's block pattern)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    return NemotronHForCausalLM(NemotronHConfig(
        **TINY, **ATTENTION, head_dim=32, layers_block_type=["mamba", "attention", "mlp"], ssm_state_size=8,
        mamba_num_heads=4, mamba_head_dim=16, n_groups=1, conv_kernel=4, expand=1, chunk_size=4))


def falcon_h1():
    """Attention and Mamba-2 side by side in every layer."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    return FalconH1ForCausalLM(FalconH1Config(**TINY, **ATTENTION, **MAMBA, mamba_d_ssm=64, num_hidden_layers=2))


def zamba2():
    """Mamba-2 layers and a shared attention block ("hybrid") called from the second."""
    from transformers import Zamba2Config, Zamba2ForCausalLM

    return Zamba2ForCausalLM(Zamba2Config(
        **TINY, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64, num_hidden_layers=2,
        layers_block_type=["mamba", "hybrid"], mamba_d_state=8, mamba_d_conv=4, mamba_expand=1,
        mamba_ngroups=1, n_mamba_heads=4, chunk_size=4, num_mem_blocks=1))


def granitemoehybrid():
    """A Mamba-2 layer and an attention layer, MoE MLPs (grouped_mm) with a shared expert."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        **TINY, **ATTENTION, **MAMBA, num_hidden_layers=2, layer_types=["mamba", "attention"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32))


def olmo_hybrid():
    """A gated-DeltaNet layer, then a full-attention layer."""
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    return OlmoHybridForCausalLM(OlmoHybridConfig(
        **TINY, **ATTENTION, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4))


def kimi_linear():
    """A KDA layer, then an MLA layer; MoE MLPs (grouped_mm)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    return KimiLinearForCausalLM(KimiLinearConfig(
        **TINY, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64, num_hidden_layers=2,
        moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, linear_head_dim=8, linear_num_heads=2,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"]))


def mamba():
    """Mamba-1: a causal convolution and the selective scan (the sequence last) in each layer."""
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM(MambaConfig(**TINY, num_hidden_layers=2, state_size=8, expand=1, conv_kernel=4,
                                        time_step_rank=8))


def falcon_mamba():
    """Mamba-1 with RMS-normalised B, C and time steps."""
    from transformers import FalconMambaConfig, FalconMambaForCausalLM

    return FalconMambaForCausalLM(FalconMambaConfig(**TINY, num_hidden_layers=2, state_size=8, expand=1,
                                                    conv_kernel=4, time_step_rank=8))


def jamba():
    """A Mamba-1 layer, then an attention layer with an MoE MLP (Jamba's pattern, periods of 2)."""
    from transformers import JambaConfig, JambaForCausalLM

    return JambaForCausalLM(JambaConfig(
        **TINY, **ATTENTION, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=1, mamba_dt_rank=8, use_mamba_kernels=False))


def recurrent_gemma():
    """Two RG-LRU blocks (a convolution of 4 and the scan written as a loop in a method), then local attention over a
    window of 8."""
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    return RecurrentGemmaForCausalLM(RecurrentGemmaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        num_hidden_layers=3, lru_width=64, attention_window_size=8, conv1d_width=4, pad_token_id=0,
        block_types=["recurrent", "recurrent", "attention"], use_cache=False))


def minimax():
    """A lightning (decayed linear) attention layer over blocks of 4 positions (model_specs/minimax.py lifts its
    inline loop), then softmax attention; an MoE in both."""
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    return MiniMaxForCausalLM(MiniMaxConfig(
        **TINY, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64, num_hidden_layers=2,
        num_local_experts=4, num_experts_per_tok=2, block_size=4, layer_types=["linear_attention", "full_attention"]))


RECURRENT = {"recurrent_gemma": recurrent_gemma}
"""Models whose recurrence is carried sequentially and whose final state the model stores (each rank then stores
the last rank's)."""


FAMILIES = {"mamba2": mamba2, "bamba": bamba, "nemotron_h": nemotron_h, "falcon_h1": falcon_h1, "zamba2": zamba2,
            "granitemoehybrid": granitemoehybrid, "qwen3_next": qwen3_next, "olmo_hybrid": olmo_hybrid,
            "kimi_linear": kimi_linear, "mamba": mamba, "falcon_mamba": falcon_mamba, "jamba": jamba,
            "minimax": minimax}


def bloom():
    """ALiBi attention written by hand on [batch * heads, S, S] (no SDPA), and an autograd.Function GeLU."""
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, pad_token_id=0,
                                        use_cache=False))


def gpt2():
    """Learned absolute positions (``wpe(arange)``), SDPA, and a loss that logs: GPT-2's config has no
    ``loss_type``, so ``loss_function`` calls ``logger.warning_once`` inside the forward."""
    from transformers import GPT2Config, GPT2LMHeadModel

    # no dropout (GPT-2's default is 0.1): each rank draws its own masks, one device other ones
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))


def mpt():
    """ALiBi from a table of max_seq_len positions sliced to the keys' length (``table[..., n - S:]``), eager
    attention written by hand."""
    from transformers import MptConfig, MptForCausalLM

    return MptForCausalLM(MptConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=64,
                                    use_cache=False))


class PositionTable(torch.nn.Module):
    """A learned absolute position table sliced to the sequence length in one of the ways models do
    (``variant``), added to token embeddings, then causal SDPA and a projection to the vocabulary."""

    VARIANTS = ("prefix", "suffix", "clamped_suffix")

    def __init__(self, variant: str, max_len: int = 32, dim: int = 16):
        super().__init__()
        self.variant = variant
        self.embed = torch.nn.Embedding(128, dim)
        self.table = torch.nn.Parameter(torch.randn(1, max_len, dim))
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, 128)

    def forward(self, input_ids, labels=None):
        s, n = input_ids.shape[1], self.table.shape[1]
        if self.variant == "prefix":
            pos = self.table[:, :s]
        elif self.variant == "suffix":
            pos = self.table[:, n - s:]
        else:
            pos = self.table[:, max(0, n - s):]
        x = self.embed(input_ids) + pos
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.out(y.transpose(1, 2).flatten(-2))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return CausalLMOutput(loss=loss, logits=logits)


def table(variant: str):
    return PositionTable(variant)


OTHERS = {"bloom": bloom, "gpt2": gpt2, "mpt": mpt,
          **{f"table_{v}": (lambda v=v: table(v)) for v in PositionTable.VARIANTS}}
"""Models without a recurrence that run the same parity task."""


STATES = {"mamba2": (4, 8, 32), "qwen3_next": (2, 8, 8), "olmo_hybrid": (2, 8, 8), "kimi_linear": (2, 8, 8),
          "mamba": (64, 8, 1), "falcon_mamba": (64, 8, 1), "jamba": (64, 8, 1), "minimax": (2, 16, 16)}
"""(heads, K, V) of each family's recurrent state per layer, as the configs above make it: Mamba-2's K is its
d_state and V its head_dim; the other Mamba-2 hybrids here have 4 heads of 16 with a d_state of 8."""


def state_shape(family: str) -> tuple[int, int, int]:
    return STATES.get(family, (4, 8, 16))


def build(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return {**FAMILIES, **OTHERS, **RECURRENT}[family]().float()


def batch(seq_len: int, documents: list[list[int]] | None = None) -> dict:
    """``labels=input_ids`` (the model shifts them), or packed rows of ``documents`` (lengths per row) with
    positions restarting at each document and labels shifted inside each."""
    if documents:
        return packed_batch(sum(documents[0]), [[(n, n) for n in row] for row in documents], 128)
    b = toy_batch(seq_len, 2, vocab=128, seed=2)
    return {"input_ids": b["input_ids"], "labels": b["input_ids"].clone()}


def _inputs(global_or_local: dict, packed: bool) -> dict:
    return packed_model_inputs(global_or_local, hf=True) if packed else global_or_local


def parity(group, family: str, seq_lens: list[int], documents: list | None = None) -> list[dict]:
    """The model compiled with spec=None (its shipped spec, by model_type), one forward/backward per length (or
    one packed batch)."""
    model = build(family)
    compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
    results = []
    for seq_len in seq_lens:
        local, layout = cp_passes.shard_batch(batch(seq_len, documents), group, compiled.spec)
        model.zero_grad()
        out = compiled(**_inputs(local, bool(documents)))
        out.loss.backward()
        results.append({"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": param_grads(model),
                        "final_states": stored_states(model),
                        "valid": layout.valid, "positions": layout.positions, "origin": compiled.spec_origin,
                        "records": [(r.rule, r.transport, r.bytes, r.lower_bound_bytes, r.source)
                                    for r in compiled.compile_records[-1].records]})
    return results


def stored_states(model) -> list[torch.Tensor]:
    """The final states the model's recurrent layers store after a forward (RecurrentGemma's ``recurrent_states``)."""
    return [m.recurrent_states.detach() for m in model.modules() if getattr(m, "recurrent_states", None) is not None]


def reference_states(family: str, seq_len: int) -> list[torch.Tensor]:
    """The final states one device's model stores after a forward on :func:`batch`."""
    model = build(family)
    model(**batch(seq_len))
    return stored_states(model)


def reference(family: str, seq_len: int, documents: list | None = None):
    """One device: the output, the gradients and which positions are real (all, or the packed documents')."""
    return hf_one_device(build(family), batch(seq_len, documents), seq_len, bool(documents))
