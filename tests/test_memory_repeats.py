"""The memory estimate of a model whose repeated blocks are nested compile regions, on a fake process group."""

import torch

from cp_passes.report.memory import saved_activation_bytes
from cp_passes.tools.dryrun import dry_run
from cp_passes.tools.models import ToyLlama, ToyLlamaConfig


def test_a_llama_of_regions_saves_what_the_flat_graph_saves(fake_group):
    """ToyLlama's six blocks as regions, against the model exported whole: the rank's saved
    activations and one device's are the same bytes (a block hands back its weights, its input and the positions'
    cos and sin for its backward: the caller's tensors, counted as the flat graph counts them)."""
    inputs = {name: ((2, 16), torch.int64) for name in ("input_ids", "labels")}
    flat, regions = (dry_run(lambda: ToyLlama(ToyLlamaConfig(n_layers=6)), inputs, mesh=fake_group, memory=True,
                             regions=r).memory for r in (None, True))
    assert regions.saved_bytes == flat.saved_bytes > 0
    assert saved_activation_bytes(regions.single_saved) == saved_activation_bytes(flat.single_saved) > 0
