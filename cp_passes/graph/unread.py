"""Values nothing reads but a metadata check, removed before planning.

dynamo checks a tensor's dtype and device after ``.to()`` with ``aten._assert_tensor_metadata``, a node FX keeps
because it has side effects. A value only such checks read is dead: transformers builds the causal mask of a
hybrid model for its attention layers, and Bamba's default config has none, so the mask's ops reached the
planner with no attention to claim them and were refused.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

_CHECK = aten._assert_tensor_metadata.default


def drop_unread_values(gm: torch.fx.GraphModule) -> bool:
    """Remove the metadata checks of values nothing else reads, then every value nothing reads; whether any was."""
    changed = gm.graph.eliminate_dead_code()
    checks = [n for n in gm.graph.find_nodes(op="call_function", target=_CHECK)
              if isinstance(n.args[0], torch.fx.Node) and all(u.target is _CHECK for u in n.args[0].users)]
    for check in checks:
        gm.graph.erase_node(check)
    changed = gm.graph.eliminate_dead_code() or bool(checks) or changed
    if changed:
        gm.recompile()
    return changed
