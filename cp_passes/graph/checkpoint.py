"""Activation checkpointing: dynamo's checkpointed regions inlined, every node tagged for recomputation.

``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)`` (what transformers'
``activation_checkpointing_enable()`` installs) reaches the backend as a ``tag_activation_checkpoint``
higher-order op whose body is a graph of its own. cp_passes must see inside it (the attention and
convolutions are there), so :func:`inline_checkpoints` replaces each such op by its body's nodes, tagged
the way torch's own lowering of the op tags them: ``recompute = PREFER_RECOMPUTE`` and one
``ac_graph_id`` per region. The tags travel with the nodes through the ATen re-trace and AOTAutograd
(both copy them), and the partitioner recomputes the tagged nodes in the backward instead of saving them.

The transports' nodes inside a region (:func:`tag_transport`) are tagged with it: their collectives run
again in the backward's recomputation, except those whose result is a scalar (a global count), which are
saved because keeping them costs nothing. Outside regions the same tag, on the nodes of a transport that
gathers keys, makes the backward gather them again instead of saving them (``CPSpec.gathered_keys``).
"""

from __future__ import annotations

import itertools
import operator

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from ..errors import CPCompileError, source_line

_REGION_IDS = itertools.count(1)
REGION = "ac_graph_id"
"""``node.meta`` key: the checkpointed region a node belongs to (torch's own key, read by the partitioner)."""


def region_of(node: torch.fx.Node) -> int | None:
    return node.meta.get(REGION)


def inline_checkpoints(gm: torch.fx.GraphModule) -> int:
    """Replace every ``tag_activation_checkpoint`` in dynamo's graph ``gm`` (nested ones too) by its body,
    tagged for recomputation. Returns the number of regions inlined."""
    regions = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.higher_order.tag_activation_checkpoint:
            regions += _inline(gm, node)
    if regions:  # no dead-code elimination: it would drop the model's in-place ops, which have no users
        gm.graph.lint()
        gm.recompile()
    return regions


def _inline(gm: torch.fx.GraphModule, call: torch.fx.Node) -> int:
    body = getattr(gm, call.args[0].target)
    if "_checkpoint_context_fn" in body.meta:
        raise CPCompileError(
            f"selective activation checkpointing (checkpoint(..., context_fn=...)) at {source_line(call)} is not "
            f"supported by cp_passes: its policy chooses among the ATen ops that AOTAutograd sees, after cp_passes "
            f"has rewritten the graph. Fix: checkpoint without context_fn (every op in the region is recomputed)"
        )
    nested = inline_checkpoints(body)
    region = next(_REGION_IDS)
    env = dict(zip(body.graph.find_nodes(op="placeholder"), call.args[1:]))
    outputs = None
    with gm.graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = torch.fx.map_arg(node.args[0], env.__getitem__)
                break
            if node.op == "get_attr":  # a nested region's body or a constant: move it onto the outer module
                name = _unique_attr(gm, node.target)
                setattr(gm, name, getattr(body, node.target))
                copied = gm.graph.get_attr(name)
                copied.meta.update(node.meta)
            else:
                copied = gm.graph.node_copy(node, env.__getitem__)
                copied.meta.setdefault("recompute", CheckpointPolicy.PREFER_RECOMPUTE)
                copied.meta.setdefault(REGION, region)
            env[node] = copied
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem and isinstance(outputs, (tuple, list)):
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
    if call.users:
        if not isinstance(outputs, torch.fx.Node):
            raise CPCompileError(f"cp_passes internal error: a checkpointed region at {source_line(call)} returns "
                                 f"{type(outputs).__name__} read other than by index")
        call.replace_all_uses_with(outputs)
    body_attr = call.args[0]
    gm.graph.erase_node(call)
    if not body_attr.users:
        gm.graph.erase_node(body_attr)
    return 1 + nested


def _unique_attr(gm: torch.fx.GraphModule, name: str) -> str:
    candidate, i = name, 0
    while hasattr(gm, candidate):
        i += 1
        candidate = f"{name}_{i}"
    return candidate


REPEATED, SAVED = "repeated in backward", "saved for backward"
REGATHERED = "gathered again in backward, not saved"
NOT_RECOMPUTED = "cp_passes_not_recomputed"
"""Node meta: a node a transport made that ``regather`` leaves to the partitioner (an attention call's result:
its output and logsumexp are what the backward should keep, not what it should compute again)."""


def tag_transport(edit, regather: bool = False) -> str:
    """Tag the nodes ``edit`` created for the partitioner (values need their ``val`` meta). Inside a checkpointed
    region they take its tags: their collectives run again in the backward's recomputation (``REPEATED``), or,
    scalars, are kept (``SAVED``). Outside one, ``regather`` (a transport that gathers keys) has them
    recomputed as well, so autograd keeps the local slice and not the gathered sequence (``REGATHERED``).
    Returns "" for nodes left to the partitioner."""
    region = region_of(edit.origin)
    if region is None and not regather:
        return ""
    policies = set()
    for node in edit.created:
        if "recompute" in node.meta or (region is None and node.meta.get(NOT_RECOMPUTED)):
            continue
        val = node.meta.get("val")
        scalar = isinstance(val, torch.Tensor) and val.dim() == 0
        if region is not None:
            node.meta[REGION] = region
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if scalar else CheckpointPolicy.PREFER_RECOMPUTE
        policies.add(node.meta["recompute"])
    if CheckpointPolicy.PREFER_RECOMPUTE not in policies:
        return SAVED if policies and region is not None else ""
    return REPEATED if region is not None else REGATHERED
