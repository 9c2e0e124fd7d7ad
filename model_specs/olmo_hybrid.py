"""transformers' OlmoHybrid: gated DeltaNet layers (its own copy of ``torch_chunk_gated_delta_rule``, declared
as in ``model_specs/qwen3_next.py``: the affine carry of the ``[batch, heads, K, V]`` state) and attention
layers, which are read from the graph.
"""

from model_specs.qwen3_next import CPSpec, gated_delta_rule

SPEC = CPSpec(name="olmo_hybrid", recurrences=(gated_delta_rule("olmo_hybrid.modeling_olmo_hybrid"),))
