"""cp_passes: context parallelism as a torch.compile backend.

``cp_compile(model, spec, mesh=...)`` rewrites the single-device graph so that each rank runs on its
contiguous slice of the sequence and gets the single-device result, or refuses at compile time.
"""

from .backend import CompileRecord, CPModule, cp_compile
from .batch import ShardLayout, shard_batch
from .errors import CPCompileError
from .explain import explain
from .rules import RuleContext, Rewrite, positionwise, register_rule
from .spec import AttentionRule, CPSpec, available_specs, load_spec
from .transports import all_reduce_gradients, gather_halo, gather_sequence

__all__ = [
    "AttentionRule", "CPCompileError", "CPModule", "CPSpec", "CompileRecord", "Rewrite", "RuleContext", "ShardLayout",
    "all_reduce_gradients", "available_specs", "cp_compile", "explain", "gather_halo", "gather_sequence", "load_spec",
    "positionwise", "register_rule", "shard_batch",
]
