"""IBM's Bamba (transformers' BambaForCausalLM): Mamba-2 layers and causal attention layers.

Its Mamba-2 mixers run transformers' own copy of ``mamba2_chunk_scan``, declared as in
``model_specs/mamba2.py`` (the affine carry of the ``[batch, heads, head_dim, d_state]`` state, ``A``, ``D``
and ``dt_bias`` whole on every rank); their short convolutions and the attention layers are read from the
graph.
"""

from model_specs.mamba2 import CPSpec, scan

SPEC = CPSpec(name="bamba", recurrences=(scan("bamba.modeling_bamba"),))
