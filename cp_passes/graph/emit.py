"""One new node of a rewritten graph, with its fake value computed as the tracer would have."""

from __future__ import annotations

import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher

from .analysis import meta_val


def emit(graph: torch.fx.Graph, like: torch.fx.Node, target, args, kwargs=None) -> torch.fx.Node:
    """``target(*args, **kwargs)`` inserted at the graph's insertion point, with ``like``'s meta (its source
    line, its stack) and the fake value of the call."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta.update({key: value for key, value in like.meta.items() if key != "val"})
    fake_args, fake_kwargs = torch.fx.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    # In the fake mode (arange makes a tensor from sizes alone) and through the Python dispatcher, as the
    # tracer ran: the C++ pad kernel would read the length as an int, pinning it with a guard.
    with meta_val(like).fake_mode, enable_python_dispatcher():
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node
