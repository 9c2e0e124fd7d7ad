"""Every op the Hugging Face zoo produces that cp_passes runs on a shard as it is, checked against one device.

The planner decides, for each ATen op that reads a sequence-sharded value, whether it is correct on a rank's
shard as it is (position-wise, or over a key axis made whole). This test does not trust those decisions. It
runs each zoo model once on one device at a global length, recording every node's real inputs and outputs,
then runs every node the planner left as it is on each rank's slice of its inputs (the rank's positions
along the sharded dims; whole along a key axis, and whole for an input the planner brings) and checks the
result against the same slice of the recorded output. A rule that calls an op position-wise when it is not,
or a key axis that is not whole, fails here with the op and its source line, as DTensor's strategy
validation checks sharding rules against a single-device ground truth.
"""

import pytest
import torch
import torch.fx

from cp_passes.compiler.planner import plan_graph
from cp_passes.errors import op_name, source_line
from cp_passes.graph.analysis import meta_val, seq_dims, seq_multiple, sequence_symbol
from cp_passes.group import CPGroup
from cp_passes.spec import CPSpec
from family_models import HF_MODELS, hf_batch

WORLD, LENGTH = 4, 16


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        self.values[n] = out = super().run_node(n)
        return out


def _record(model, batch: dict):
    """The model's ATen graph (sequence dim symbolic) and every node's value at the global length."""
    seq = torch.export.Dim("seq", min=LENGTH // WORLD)  # the shortest shard
    exported = torch.export.export(model, (), batch, dynamic_shapes={k: {1: seq} for k in batch}, strict=False)
    gm = exported.module()
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    recorder = _Recorder(gm)
    recorder.run(*[batch[p.name] for p in placeholders])
    (sym,) = sequence_symbol(placeholders)
    return gm, sym, recorder.values


def _outputs(node) -> list:
    val = meta_val(node)
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _sharded_dims(node, value, sym, plan) -> list[int] | None:
    """The dims of ``value`` (an input of ``node``, or ``node``'s own output) that hold this rank's positions;
    None when one is the sequence merged with another dim, which this check does not slice."""
    if isinstance(value, torch.fx.Node) and value in plan.as_is.get(node, ()):
        return []  # brought whole from every rank
    val = meta_val(value) if isinstance(value, torch.fx.Node) else value
    if not isinstance(val, torch.Tensor):
        return []
    key = plan.keys.get(value if isinstance(value, torch.fx.Node) else node)
    dims = [d for d in seq_dims(val, sym) if d != key]
    return None if any(seq_multiple(val.shape[d], sym) != 1 for d in dims) else dims


def _shard(value: torch.Tensor, dims: list[int], rank: int) -> torch.Tensor:
    for d in dims:
        local = value.shape[d] // WORLD
        value = value.narrow(d, rank * local, local)
    return value


def _check_node(node, sym, plan, values, rank) -> str | None:
    """Why ``node`` run on ``rank``'s slices differs from the slice of its single-device value (None: same)."""

    def local(a):
        val = meta_val(a)
        if isinstance(val, torch.SymInt):  # a size: its value at the local length
            return int(val.node.expr.subs(sym, LENGTH // WORLD))
        value = values[a]
        if isinstance(value, (tuple, list)):  # a multi-output op's results, each sharded by its own dims
            return type(value)(_shard(v, _sharded_dims(a, m, sym, plan), rank) if isinstance(v, torch.Tensor) else v
                                for v, m in zip(value, _outputs(a)))
        return _shard(value, _sharded_dims(node, a, sym, plan), rank) if isinstance(value, torch.Tensor) else value

    args, kwargs = torch.fx.map_arg((node.args, node.kwargs), local)
    got = node.target(*args, **kwargs)
    want = values[node]
    pairs = zip(got, want, _outputs(node)) if isinstance(want, (tuple, list)) else [(got, want, meta_val(node))]
    for g, w, val in pairs:
        if not isinstance(w, torch.Tensor):
            continue
        w = _shard(w, _sharded_dims(node, val, sym, plan), rank)
        if g.shape != w.shape:
            return f"shape {tuple(g.shape)} on rank {rank}, expected {tuple(w.shape)}"
        if not (torch.allclose(g, w, rtol=1e-5, atol=1e-6, equal_nan=True) if w.is_floating_point()
                else torch.equal(g, w)):
            return f"values differ on rank {rank} by up to {(g.double() - w.double()).abs().max().item():.3g}"
    return None


# DeepSeek-V3 exported copies into slices of a new tensor in place (expand_kv), which cp_compile's capture sees
# functionalized; its parity runs in tests/test_narrowest_keys.py
@pytest.mark.parametrize("family", sorted(f for f in HF_MODELS if not f.startswith("deepseek-v3")))
def test_ops_left_as_they_are_match_one_device_on_every_shard(family):
    model = HF_MODELS[family]()
    model.config.use_cache = False  # export cannot return a cache object
    gm, sym, values = _record(model, hf_batch(LENGTH, labels_in_model=True))
    checked, skipped, wrong = set(), set(), []
    for rank in range(WORLD):
        plan = plan_graph(gm, sym, CPSpec(), CPGroup(None, "sweep", rank, WORLD))
        for node in plan.as_is:
            dims = [_sharded_dims(node, a, sym, plan) for a in node.all_input_nodes]
            dims += [_sharded_dims(node, val, sym, plan) for val in _outputs(node)]
            if None in dims:
                skipped.add(op_name(node))
                continue
            checked.add(op_name(node))
            why = _check_node(node, sym, plan, values, rank)
            if why is not None:
                wrong.append(f"{op_name(node)} at {source_line(node)}: {why}")
    assert not wrong, "\n".join(wrong)
    print(f"{family}: {len(checked)} ops checked on {WORLD} shards: {sorted(checked)}; "
          f"skipped (sequence merged with another dim): {sorted(skipped - checked)}")
    assert len(checked) >= 10, (checked, skipped)
