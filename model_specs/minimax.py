"""MiniMax-Text-01 (transformers' MiniMaxForCausalLM): lightning attention (decayed linear attention) in most
layers, softmax attention with RoPE in the rest, an MoE in every layer.

Lightning attention computes ``o_t = q_t S_t`` with ``S_t = exp(-slope) S_{t-1} + k_t^T v_t`` per head, as a
Python loop over blocks of ``block_size`` positions written inline in ``MiniMaxLightningAttention.forward``:
nothing outside the forward can hand that loop a state, and dynamo unrolls it at the compile-time length. This
spec lifts it: :func:`lightning_forward` is the shipped forward with the block loop moved into
:func:`lightning_attention` (the same ops in the same order, taking an initial state), declared as an affine
recurrence (the state ``[batch, heads, K, V]`` maps as ``exp(-slope L) S0 + h``). A decode step, whose cache
already holds a state, runs the shipped forward. The softmax layers' causal masks and the experts are read from
the graph.
"""

import torch
from transformers.models.minimax import modeling_minimax
from transformers.utils.deprecation import deprecate_kwarg

from cp_passes.lifted import shipped
from cp_passes.spec import CPSpec, LiftedForward, Recurrence

_TARGET = "transformers.models.minimax.modeling_minimax:MiniMaxLightningAttention.forward"


def lightning_attention(query, key, value, slope_rate, query_decay, key_decay, diagonal_decay, block_size,
                        initial_state=None, output_final_state=False):
    """The shipped forward's block loop on ``[batch, heads, seq, dim]`` query, key and value, from ``initial_state``
    ``[batch, heads, K, V]`` (zeros when None): ``(output, final state or None)``. The module's decay buffers come
    flattened (a tensor argument with a shard's length on the sequence dim would read as a sequence, and
    ``block_size`` may equal a shard's length)."""
    batch, heads, length, _ = query.shape
    slope_rate = slope_rate.view(heads, 1, 1)
    query_decay, key_decay = query_decay.view(heads, block_size, 1), key_decay.view(heads, block_size, 1)
    diagonal_decay = diagonal_decay.view(1, heads, block_size, block_size)
    state = initial_state
    if state is None:
        state = torch.zeros(batch, heads, key.shape[-1], value.shape[-1], device=value.device, dtype=value.dtype)
    output = []
    for start in range(0, length, block_size):
        end = min(start + block_size, length)
        n = end - start
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        intra = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * diagonal_decay[:, :, :n, :n], v)
        inter = torch.matmul(q * query_decay[:, :n], state)
        output.append(inter + intra)
        state = state * torch.exp(-slope_rate * n) + torch.matmul((k * key_decay[:, -n:]).transpose(-1, -2), v)
    return torch.cat(output, dim=-2), (state if output_final_state else None)


@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
def lightning_forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    """``MiniMaxLightningAttention.forward`` of transformers 5.24 with its block loop lifted into
    :func:`lightning_attention`."""
    if cache is not None and cache.get_linear_cache(self.layer_idx) is not None:
        return shipped(_TARGET)(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    batch_size, seq_len, hidden_size = hidden_states.shape

    qkv_states = self.act_fn(self.qkv_proj(hidden_states))
    qkv_states = modeling_minimax.apply_mask_to_padding_states(qkv_states, attention_mask)
    qkv_states = qkv_states.reshape(batch_size, seq_len, self.num_attention_heads, 3 * self.head_dim)
    query_states, key_states, value_states = torch.split(qkv_states, self.head_dim, dim=3)
    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    value_states = value_states.transpose(1, 2)

    attn_output, attn_weights_inter = lightning_attention(
        query_states, key_states, value_states, self.slope_rate.flatten(), self.query_decay.flatten(),
        self.key_decay.flatten(), self.diagonal_decay.flatten(), self.block_size, initial_state=None,
        output_final_state=cache is not None)

    attn_output = attn_output.transpose(1, 2)
    attn_output = attn_output.reshape(batch_size, seq_len, self.num_attention_heads * self.head_dim)
    attn_output = self.norm(attn_output)
    attn_output = torch.sigmoid(self.output_gate(hidden_states)) * attn_output
    attn_output = self.out_proj(attn_output)
    if cache is not None:
        cache.set_linear_cache(self.layer_idx, attn_weights_inter)
    return attn_output, attn_weights_inter


SPEC = CPSpec(
    name="minimax",
    recurrences=(Recurrence("model_specs.minimax:lightning_attention", ("query", "key", "value"), form="affine",
                            tensor_args=("slope_rate", "query_decay", "key_decay", "diagonal_decay"), seq_dim=2),),
    lifted_forwards=(LiftedForward(_TARGET, "model_specs.minimax:lightning_forward", "03c3f915c0c99c09"),),
)
