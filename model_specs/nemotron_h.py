"""transformers' NemotronH: Mamba-2 layers (its own copy of ``mamba2_chunk_scan``, declared as in
``model_specs/mamba2.py``: the affine carry of the ``[batch, heads, head_dim, d_state]`` state, ``A``, ``D`` and
``dt_bias`` whole on every rank) with attention and MLP layers, which are read from the graph.
"""

from model_specs.mamba2 import CPSpec, scan

SPEC = CPSpec(name="nemotron_h", recurrences=(scan("nemotron_h.modeling_nemotron_h"),))
