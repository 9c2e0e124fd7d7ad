"""Moonshot's Kimi Linear (transformers' KimiLinearForCausalLM): Kimi Delta Attention layers, MLA layers, MoE.

Its KDA layers run short causal convolutions (read from the graph) and ``chunk_kimi_delta_attention``, the
kernel GLM-5.3-Flash's linear layers run (``model_specs/glm5_next.py``): the affine carry hands its
``[batch, heads, K, V]`` state from rank to rank. On GPU the module attribute dispatches to
flash-linear-attention's ``chunk_kda`` when it is installed. MLA and the MoE (grouped_mm) need nothing
declared.
"""

from cp_passes.spec import CPSpec, Recurrence

SPEC = CPSpec(name="kimi_linear", recurrences=(
    Recurrence("transformers.models.kimi_linear.modeling_kimi_linear:chunk_kimi_delta_attention",
               ("query", "key", "value", "g", "beta"), form="affine"),))
