"""DeepSeek V4.1's public relative in transformers: DeepseekV4ForCausalLM.

Its compressed attention groups the sequence into windows: heavily compressed attention (HCA) pools
windows of ``compress_rates["heavily_compressed_attention"]`` (128) positions, compressed sparse attention
(CSA) windows of ``compress_rates["compressed_sparse_attention"]`` (4), each paired with the previous window.
Every shard must hold whole windows of both, so ``pad_multiple`` is their least common multiple, which
``shard_batch`` pads to, and packed documents start at multiples of it (``packed_alignment``). ``SPEC``'s 128
suits the released rates; ``cp_compile(model, "deepseek_v4")`` reads the rates from ``model.config``
(:func:`for_config`), and a config with others replaces them. Shard with the compiled module's spec,
``shard_batch(batch, group, compiled.spec)``, or ``load_spec("deepseek_v4", config=model.config)``: the name
alone gives ``SPEC``, for the released rates.

Everything else is read from the graph. The windows' positions become global and the CSA pairing (a slice
written at an offset into a fresh tensor) is a shift of one window. Each attention's key axis concatenates the
raw positions and the compressed entries (``cat([kv, compressed], dim=2)``) and is brought part by part, each
part gathered along its own axis and concatenated as on one device: the raw keys are cut by the masks' first
part, the sliding window, to a halo of ``window - 1`` rows; every compressed entry comes (S/m rows, not cut to
the causal prefix). The masks (the sliding window, the HCA causal block rule ``entry < (position + 1) // m``,
the CSA indexer's top-k over the compressed entries, which reads activations in windows) are evaluated at this
rank's query rows and every key, then cut to the keys brought and checked at run time to hide the rest (never
``[S, S]``; the indexer's own scores are still computed for every query, ``[S, S/m]`` on every rank). An input
a mask reads only the shape of (``compressed_kv.new_zeros(..)``) is not gathered.

The MoE layers (routed and hash-routed) run on transformers' default experts implementation, grouped_mm,
which cp_passes proves local to each rank.
"""

import math

from cp_passes.spec import CPSpec

SPEC = CPSpec(
    name="deepseek_v4",
    seq_inputs=("input_ids", "position_ids", "labels", "shift_labels", "doc_ids"),
    position_keys=("position_ids",),
    pad_multiple=128,
    packed_alignment=128,
    # Contiguous shards until the balanced layout is shown exact here: at P = 4 on packed rows its head's
    # hyper-connection scale gradient (a sum that cancels) differs from one device by 1.9e-3 of itself,
    # above twice the balanced cut's one-device rounding floor (1.4e-3); logits and loss match.
    layout="contiguous",
)


def for_config(config) -> CPSpec:
    """``SPEC`` for ``config``'s compression rates: shards and packed documents in whole windows of every rate
    (their least common multiple)."""
    rates = [int(r) for r in (getattr(config, "compress_rates", None) or {}).values() if r]
    multiple = math.lcm(*rates) if rates else 1
    return SPEC.replace(pad_multiple=multiple, packed_alignment=multiple)
