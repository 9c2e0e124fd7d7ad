"""TII's FalconMamba (transformers' FalconMambaForCausalLM): Mamba-1 with RMS-normalised B, C and time steps,
its own copy of ``mamba_selective_scan``, declared as in ``model_specs/mamba.py``."""

from model_specs.mamba import CPSpec, scan

SPEC = CPSpec(name="falcon_mamba", recurrences=(scan("falcon_mamba.modeling_falcon_mamba"),))
