"""Llama-family causal LMs (cp_passes' ToyLlama, Hugging Face LlamaForCausalLM and look-alikes).

Everything else is read from the graph: causal attention from SDPA's is_causal, GQA from
enable_gqa or the K/V head repeat, positions from position_ids or an arange over the sequence.
"""

from cp_passes.spec import CPSpec

SPEC = CPSpec(
    name="llama",
    seq_inputs=("input_ids", "position_ids", "labels", "shift_labels"),
    label_keys=("labels", "shift_labels"),
    position_keys=("position_ids",),
)
