"""cp_passes: context parallelism as a torch.compile backend.

``cp_compile(model, spec, mesh=...)`` rewrites the single-device graph so that each rank runs on its
slice of the sequence and gets the single-device result, or refuses at compile time.
"""

from .compiler.backend import CPModule, cp_compile
from .compiler.pipeline import CompileRecord
from .data.batch import ShardLayout, shard_batch
from .data_parallel import global_loss, global_token_count, sum_gradients
from .helpers import all_reduce_gradients, gather_halo, gather_sequence
from .errors import CPCompileError
from .layout import Layout
from .report.explain import explain
from .rules import Rewrite, RuleContext, Value, positionwise, register_rule
from .spec import AttentionRule, CPSpec, LiftedForward, Recurrence, available_specs, load_spec
from .transports import Cost, Transport, register_transport

__all__ = [
    "AttentionRule", "CPCompileError", "CPModule", "CPSpec", "CompileRecord", "Cost", "Layout", "LiftedForward",
    "Recurrence", "Rewrite", "RuleContext", "ShardLayout", "Transport", "Value", "all_reduce_gradients",
    "available_specs", "cp_compile", "explain", "gather_halo", "gather_sequence", "global_loss",
    "global_token_count", "load_spec", "positionwise", "register_rule", "register_transport", "shard_batch",
    "sum_gradients",
]
