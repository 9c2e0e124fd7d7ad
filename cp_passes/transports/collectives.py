"""The collectives the transports' runtime ops issue, addressed by group name and waited on at once.

They run inside the ``cp_passes::*`` custom ops, eagerly, whatever compiled the graph around them.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol


def _waited(result) -> torch.Tensor:
    return funcol.wait_tensor(result) if isinstance(result, funcol.AsyncCollectiveTensor) else result


def all_to_all(rows: torch.Tensor, recv: list[int], send: list[int], group_name: str) -> torch.Tensor:
    """Send ``send[r]`` leading-dim rows of ``rows`` (in rank order) to rank ``r``; receive ``recv[q]`` from ``q``."""
    return _waited(funcol.all_to_all_single(rows.contiguous(), recv, send, group_name))


def all_gather(rows: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Every rank's ``rows`` concatenated along dim 0 in rank order."""
    return _waited(funcol.all_gather_single(rows.contiguous(), 0, group_name))


def reduce_scatter(rows: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """The sum over ranks of this rank's ``1 / world`` of ``rows`` along dim 0."""
    return _waited(funcol.reduce_scatter_single(rows.contiguous(), "sum", 0, group_name))


def all_reduce_sum(value: torch.Tensor, group_name: str) -> torch.Tensor:
    return _waited(funcol.all_reduce(value, "sum", group_name))
