"""Keys computed again where they arrive: the narrowest tensors attention's K and V derive from position by
position move in their place (:class:`~cp_passes.graph.narrowest.Recompute`, an MLA latent), and the position-wise
ops between them run again on the rows received. Each copied row is the row the sending rank would have made (the
ops are position-wise), and autograd carries the gradients of the copies back through the move to the ranks that
own the rows (a gather's backward reduce-scatters), so the result and the gradients are the single device's.

The positions the copies read (RoPE's) are computed where they come from the layout (an ``arange``: the keys'
global positions, no bytes); other free values (a table's rows, which may be trained) move as the keys do, with
autograd."""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx

from ..graph.analysis import meta_val
from ..graph.narrowest import Recompute
from ..key_plan import KeyPlan
from .masks import key_positions

aten = torch.ops.aten


def computed_positions(node: torch.fx.Node, plan: KeyPlan) -> bool:
    """Whether the free value ``node`` is positions the layout gives (``arange`` over the local sequence, 1-D):
    its rows at the keys the plan brings are computed, not moved. Not from each range's first key (packed
    documents): where those start depends on the data."""
    value = meta_val(node)
    return (not plan.first_keys and getattr(node.target, "overloadpacket", None) is aten.arange
            and isinstance(value, torch.Tensor) and value.dim() == 1)


def positions_of_keys(local: torch.Tensor, rank: int, world: int, kind: str, causal: bool) -> torch.Tensor:
    """The global positions of the keys a gather brings (the causal prefix in global order, or every key in rank
    order), in ``local``'s dtype: ``local`` holds this rank's."""
    return key_positions(local.shape[0], rank, world, kind, None, local.device, causal=causal).to(local.dtype)


def recompute_at_rows(edit, path: Recompute, plan: KeyPlan, move: Callable) -> dict[torch.fx.Node, torch.fx.Node]:
    """Copies, before ``edit``'s origin, of ``path``'s nodes over the rows ``move(x, dim, name)`` brings:
    the narrowest tensors and the free values (positions from the layout computed). Returns the copy of every
    node."""
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, (node, dim) in enumerate(path.moved):
        copies[node] = move(edit.current(node), dim, f"cp_rows{i}")
    for i, (node, dim) in enumerate(path.free):
        if computed_positions(node, plan):
            copies[node] = edit.insert(positions_of_keys, (edit.current(node), edit.rank, edit.world,
                                                           edit.layout.kind, plan.reach.causal),
                                       name=f"cp_key_positions{i}")
        else:
            copies[node] = move(edit.current(node), dim, f"cp_positions{i}")
    first, dim = path.moved[0]
    length = edit.insert(aten.sym_size.int, (copies[first], dim), name="cp_rows_length")
    for node in path.lengths:
        copies[node] = length
    for node in path.nodes:
        copies[node] = edit.copy(node, copies, name=f"cp_again_{node.name}")
    return copies
