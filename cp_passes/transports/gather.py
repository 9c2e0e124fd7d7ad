"""Sequence gather: the keys and values SDPA reads from other ranks, where no halo brings them.

Full (bidirectional) attention all-gathers every rank's shard in the layout's gather order (backward: a
reduce-scatter); causal attention brings only what its queries can see, the causal prefix (for packed documents
from each range's first key its mask shows): the moves of :mod:`.key_move`, which :mod:`.attention` calls for
SDPA's K and V. This module is the transport's entry in the table.
"""

from __future__ import annotations

import torch

from ..layout import KINDS
from .attention import AttentionKV, attention_cost, rewrite_attention
from .base import Cost, Transport, register_transport
from .key_move import runtime as key_movers_runtime
from .reductions import global_sum_op  # noqa: F401  (registers cp_passes::global_sum)


class SequenceGather(Transport):
    name = "sequence_gather"
    order = 30
    layouts = KINDS
    gathers_keys = True

    @property
    def runtime(self) -> tuple:
        return key_movers_runtime() + (torch.ops.cp_passes.global_sum.default,)

    def apply(self, edit, request: AttentionKV) -> None:
        rewrite_attention(edit, request)

    def cost(self, request: AttentionKV, layout, rank, local_len) -> Cost:
        return attention_cost(request, layout, rank, local_len)


SEQUENCE_GATHER = register_transport(SequenceGather())
