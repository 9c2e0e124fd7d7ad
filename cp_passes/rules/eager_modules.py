"""Modules run eagerly (``cp_passes::eager_module``): allowed only on whole inputs."""

from __future__ import annotations

import torch

from ..eager_modules import module_path
from ..transports.eager_modules import EagerCall
from .registry import Rewrite, RuleContext, register_rule


@register_rule(torch.ops.cp_passes.eager_module.default, always=True)
def _eager_module(ctx: RuleContext):
    path = module_path(ctx.node.args[0])
    sharded = [t.name for t in ctx.seq_inputs()]
    if sharded:
        ctx.refuse(f"the eager module {path!r} takes sequence-sharded inputs {sharded}: run outside the analysed "
                   f"graph, it would see this rank's slice alone",
                   f"name in eager_modules only modules whose inputs every rank passes whole (a vision tower's "
                   f"pixels and grid sizes), or remove {path!r} from it")
    return Rewrite("eager_module", "eager_modules", EagerCall(ctx.node, path),
                   note=f"{path}: ran eagerly on every rank with whole inputs; its backward runs it again")
