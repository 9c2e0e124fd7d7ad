"""Key axis: bring what a hand-written attention reads along its key axis from every rank.

The planner asks for :class:`KeyOperand` where a sequence-sharded tensor lands on the key axis of a
``[q, k]`` block (K in ``q @ k^T``, V in ``probs @ v``, a key-side bias), and for :class:`KeyMask` where a
block is combined with a mask the model builds from sequence metadata. An operand is gathered where it is
smallest (before a GQA head repeat and any transposes), then the ops between are replayed on the gathered
tensor; a mask is evaluated over the whole sequence from gathered metadata and this rank's query rows taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..graph.analysis import meta_val, numel_hint
from ..layout import Layout
from .attention import global_mask
from .base import Cost, Transport, register_transport
from .gather import sequence_gather_op  # noqa: F401  (registers cp_passes::sequence_gather)
from .masks import MetadataMask, metadata_gather_op  # noqa: F401  (registers cp_passes::metadata_gather)

aten = torch.ops.aten


@dataclass
class KeyOperand:
    """``operand`` lands on the key axis of ``consumers``: gather ``source`` along ``dim`` and replay
    ``steps`` (nodes to copy, or an int: a head repeat of that many) to rebuild it whole."""

    operand: torch.fx.Node
    source: torch.fx.Node
    dim: int
    steps: list
    consumers: list[torch.fx.Node] = field(default_factory=list)

    @property
    def metadata(self) -> bool:
        return not meta_val(self.source).is_floating_point()

    def describe(self) -> str:
        where = f"'{self.source.name}'" + (f" (for '{self.operand.name}')" if self.source is not self.operand else "")
        repeats = [s for s in self.steps if isinstance(s, int)]
        return where + (f", before its x{repeats[0]} head repeat" if repeats else "")


@dataclass
class KeyMask:
    """A mask the model builds from metadata, combined with a block whose query axis is ``query_dim``."""

    mask: MetadataMask
    query_dim: int


def query_rows(global_mask: torch.Tensor, query_dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's query rows of a mask evaluated over the whole sequence (every key kept)."""
    local = global_mask.shape[query_dim] // world
    return global_mask.index_select(query_dim, Layout(world).positions(rank, local, global_mask.device))


class KeyGather(Transport):
    name = "key_gather"
    order = 35
    runtime = (torch.ops.cp_passes.sequence_gather.default, torch.ops.cp_passes.metadata_gather.default)

    def apply(self, edit, request) -> None:
        if isinstance(request, KeyMask):
            whole = global_mask(edit, request.mask)
            rows = edit.insert(query_rows, (whole, request.query_dim, edit.rank, edit.world), name="cp_mask_rows")
            edit.replace_uses(request.mask.mask, rows)
            return
        op = torch.ops.cp_passes.metadata_gather if request.metadata else torch.ops.cp_passes.sequence_gather
        source = edit.current(request.source)  # an earlier transport may have made it global (a scan, positions)
        brought = edit.insert(op.default, (source, request.dim, edit.world, edit.group_name),
                              name=f"cp_{request.source.name}_keys")
        for step in request.steps:
            if isinstance(step, int):
                brought = edit.insert(aten.repeat_interleave.self_int, (brought, step, 1),
                                      name=f"cp_{request.operand.name}_heads")
            else:
                brought = edit.copy(step, {step.args[0]: brought}, name=f"cp_{step.name}_keys")
        operand = edit.current(request.operand)
        for consumer in request.consumers:
            consumer.replace_input_with(operand, brought)
            edit.changed(consumer)

    def cost(self, request, layout, rank, local_len) -> Cost:
        if isinstance(request, KeyMask):
            leaves = request.mask.tensor_leaves
            moved = sum(numel_hint(leaf) * meta_val(leaf).dtype.itemsize for leaf in leaves) * (layout.world - 1)
            return Cost(f"all_gather {', '.join(leaf.name for leaf in leaves)} (no grad)" if leaves else "none",
                        0, moved, moved, moved)
        elements = numel_hint(request.source) * (layout.world - 1)
        moved = elements * meta_val(request.source).dtype.itemsize
        collective = "all_gather (no grad)" if request.metadata else "all_gather | bw reduce_scatter"
        # Every key may be read: the mask of a hand-written attention is not analysed for a causal prefix.
        return Cost(collective, elements, moved, moved, moved)


KEY_GATHER = register_transport(KeyGather())
