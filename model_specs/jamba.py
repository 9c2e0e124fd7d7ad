"""AI21's Jamba (transformers' JambaForCausalLM): Mamba-1 layers (its own copy of ``mamba_selective_scan``,
declared as in ``model_specs/mamba.py``), attention layers and MoE MLPs, which are read from the graph."""

from model_specs.mamba import CPSpec, scan

SPEC = CPSpec(name="jamba", recurrences=(scan("jamba.modeling_jamba"),))
