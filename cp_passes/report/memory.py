"""What a compiled graph keeps for its backward, per rank, read from AOTAutograd's partition.

The backward graph's inputs are the incoming gradients (``tangents_*``) and everything the forward saved for
it; the saved tensors' sizes at the compiled length are this rank's saved activations (parameters the
backward reads are among them: they are the forward's inputs, not extra memory, and are counted apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import meta_val, numel_hint


@dataclass(frozen=True)
class Saved:
    name: str
    shape: str
    bytes: int
    primal: bool
    """An input of the forward (a parameter, a batch tensor): read by the backward, not kept by it."""


def saved_for_backward(backward: torch.fx.GraphModule) -> list[Saved]:
    saved = []
    for node in backward.graph.find_nodes(op="placeholder"):
        val = meta_val(node)
        if node.name.startswith("tangents") or not isinstance(val, torch.Tensor):
            continue
        saved.append(Saved(node.name, str(tuple(val.shape)), numel_hint(node) * val.element_size(),
                           node.name.startswith("primals")))
    return saved


def saved_activation_bytes(saved: list[Saved]) -> int:
    """The bytes the forward kept for the backward beyond its own inputs."""
    return sum(s.bytes for s in saved if not s.primal)
