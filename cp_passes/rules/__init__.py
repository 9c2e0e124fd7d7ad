"""The rule table: how each ATen op behaves when an input is sharded along the sequence.

A rule is a function ``rule(ctx: RuleContext)`` registered for one or more ops (an ``OpOverload`` or a
whole ``OpOverloadPacket``)::

    @cp_passes.register_rule(torch.ops.mylib.rowwise_gelu)
    def _(ctx):
        ctx.require_not_along_sequence(ctx.arg("dim"))   # refuses if it would mix positions
        return None                                      # position-wise: nothing to rewrite

Rules decide and nothing else (see :mod:`.registry` for what they return); matchers (:mod:`cp_passes.match`)
find multi-node patterns first; transports (:mod:`cp_passes.transports`) edit the graph and count bytes.
Importing this package registers the built-in rules: one module per op family.
"""

from . import (attention, contractions, conv, eager_modules, permutations, picks, pointwise,  # noqa: F401
               positions, recurrence, reductions, splice, views)
from .registry import (NO_RULE_FIX, Refusal, Rewrite, RuleContext, Value, lookup_rule, positionwise,
                       positionwise_rule, register_rule)
from .views import VIEW_OPS

__all__ = ["VIEW_OPS", "NO_RULE_FIX", "Refusal", "Rewrite", "RuleContext", "Value", "lookup_rule", "positionwise",
           "positionwise_rule", "register_rule"]
