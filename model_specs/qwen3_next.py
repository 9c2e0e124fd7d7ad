"""Qwen3-Next (transformers' Qwen3NextForCausalLM): gated DeltaNet layers, gated full-attention layers, MoE.

Its linear-attention layers run a short causal convolution (read from the graph: a halo of kernel - 1 rows)
and ``torch_chunk_gated_delta_rule``, the gated delta rule the model calls as a Python function looping over
chunks, with a ``[batch, heads, K, V]`` state per layer: the affine carry hands it from rank to rank (one
all-gather of every rank's ``[h | M]`` per layer, state-sized). On GPU the same module attribute dispatches
to flash-linear-attention's ``chunk_gated_delta_rule`` when it is installed. The attention layers and the MoE
(transformers' default experts implementation, grouped_mm) need nothing declared.

The CPU path takes no document boundaries: packed rows run the state across documents, as on one device.
"""

from cp_passes.spec import CPSpec, Recurrence


def gated_delta_rule(module: str) -> Recurrence:
    """The Recurrence of ``torch_chunk_gated_delta_rule`` as defined in transformers' ``module``."""
    return Recurrence(f"transformers.models.{module}:torch_chunk_gated_delta_rule",
                      ("query", "key", "value", "g", "beta"), form="affine")


SPEC = CPSpec(name="qwen3_next", recurrences=(gated_delta_rule("qwen3_next.modeling_qwen3_next"),))
