"""Transports as units (registry, planning, verify), provenance tags in the AOT graphs, and the Layout's maps.

Compiles run on a fake process group (rank 3 of 8, one process, aot_eager): structure only."""

import re
from dataclasses import dataclass

import pytest
import torch
import torch.fx
import torch.nn as nn
from hypothesis import given, strategies as st

import cp_passes
from cp_passes import CPCompileError, Layout
from cp_passes.tools.models import ToyLlama, ToyLlamaConfig
from cp_passes.transports import TRANSPORTS, unregister_transport

RANK, WORLD = 3, 8


@torch.library.custom_op("cp_passes_test::running_scale", mutates_args=())
def running_scale(x: torch.Tensor) -> torch.Tensor:
    """A stand-in for an op whose rule asks for a transport (think: a recurrent kernel that needs a carry)."""
    return x * 2


@running_scale.register_fake
def _(x):
    return torch.empty_like(x)


running_scale.register_autograd(lambda ctx, grad: grad * 2)


class UsesRunningScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, ids):
        return running_scale(self.embed(ids))


@dataclass
class Carry:
    node: torch.fx.Node


@pytest.fixture
def rule_asking_for():
    """Register a rule for running_scale that asks for the named transport; restore the table after."""
    from cp_passes.rules.registry import _RULES

    op = torch.ops.cp_passes_test.running_scale

    def register(transport):
        @cp_passes.register_rule(op)
        def _(ctx):
            return cp_passes.Rewrite("running_scale_carry", transport, Carry(ctx.node), note="toy")

    yield register
    _RULES.pop(op, None)


def compile_once(group, model):
    """The test transports support the contiguous layout only (``Transport.layouts``' default)."""
    compiled = cp_passes.cp_compile(model, cp_passes.CPSpec(layout="contiguous"), mesh=group, backend="aot_eager",
                                    verbose=False)
    return compiled, compiled(torch.randint(0, 32, (2, 8)))


def test_a_rewrite_naming_an_unknown_transport_is_refused_at_plan_time(group, rule_asking_for):
    rule_asking_for("relay")
    assert "relay" not in TRANSPORTS
    with pytest.raises(CPCompileError) as info:
        compile_once(group, UsesRunningScale())
    text = str(info.value)
    assert "rule 'running_scale_carry'" in text and "transport 'relay', which is not registered" in text
    assert "test_transports.py" in text  # the source line of the op whose rule asked


class DoesNothing(cp_passes.Transport):
    name, order = "toy_noop", 35

    def apply(self, edit, request):
        return None  # forgets to edit the graph


class ScalesByOne(cp_passes.Transport):
    """A working toy transport: scales the op's output by 1 after it (a real one would move data)."""

    name, order = "toy_scale", 37

    def apply(self, edit, request):
        node = request.node
        users = list(node.users)
        scaled = edit.insert(torch.ops.aten.mul.Tensor, (node, 1), name="cp_toy_scaled", before=node.next)
        for user in users:
            user.replace_input_with(node, scaled)

    def cost(self, request, layout, rank, local_len):
        return cp_passes.Cost("none (toy)", 0, 0, 0, 0)


@pytest.fixture
def registered():
    added = []

    def register(transport):
        added.append(cp_passes.register_transport(transport).name)

    yield register
    for name in added:
        unregister_transport(name)


def test_a_planned_rewrite_that_was_not_applied_fails_verify(group, rule_asking_for, registered):
    registered(DoesNothing())
    rule_asking_for("toy_noop")
    with pytest.raises(CPCompileError) as info:
        compile_once(group, UsesRunningScale())
    text = str(info.value)
    assert "internal error: planned rewrites were not applied" in text
    assert "running_scale_carry" in text and "transport 'toy_noop'" in text


def test_a_registered_transport_runs_in_order_and_shows_in_the_table(group, rule_asking_for, registered):
    registered(ScalesByOne())
    rule_asking_for("toy_scale")
    compiled, out = compile_once(group, UsesRunningScale())
    assert out.shape == (2, 8, 8)
    record = compiled.compile_records[0]
    labels = [label for label, _ in record.history]
    assert labels.index("after toy_scale (1 rewrites)") == labels.index("after key_gather (0 rewrites)") + 1
    (row,) = [r for r in record.records if r.transport == "toy_scale"]
    assert row.rule == "running_scale_carry" and row.collective == "none (toy)"
    assert "# cp_passes: pass=toy_scale rule=running_scale_carry" in record.history[-1][1]


def tagged_lines(code: str, op: str) -> list[str]:
    return [line for line in code.splitlines() if re.search(rf"= torch\.ops\.{re.escape(op)}\(", line)]


def test_tags_survive_into_the_aot_forward_and_backward_graphs(group):
    torch.manual_seed(0)
    model = ToyLlama(ToyLlamaConfig(n_layers=2, window=5, conv_kernel=3))
    compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
    ids = torch.randint(0, 256, (2, 16))
    loss, _ = compiled(ids, labels=ids)
    loss.backward()
    record = compiled.compile_records[0]
    forward, backward = record.aot_graphs["forward"], record.aot_graphs["backward"]
    expected = {
        (forward, "cp_passes.halo.default"): {"pass=halo rule=causal_conv_slice", "pass=halo rule=sdpa_window"},
        (backward, "cp_passes.halo_backward.default"): {"pass=halo rule=causal_conv_slice",
                                                        "pass=halo rule=sdpa_window"},
    }
    for (code, op), tags in expected.items():
        lines = tagged_lines(code, op)
        assert len(lines) == 4, (op, lines)  # 2 layers x (conv halo, K+V halo)
        found = {re.search(r"# cp_passes: (pass=\S+ rule=\S+)", line).group(1) for line in lines}
        assert found == tags, (op, lines)


def test_tags_of_gather_and_count_in_the_aot_graphs(group):
    torch.manual_seed(0)
    compiled = cp_passes.cp_compile(ToyLlama(ToyLlamaConfig(n_layers=2)), mesh=group, backend="aot_eager",
                                    verbose=False)
    ids = torch.randint(0, 256, (2, 16))
    loss, _ = compiled(ids, labels=ids)
    loss.backward()
    record = compiled.compile_records[0]
    for code, op in ((record.aot_graphs["forward"], "cp_passes.prefix_pack.default"),
                     (record.aot_graphs["forward"], "_c10d_functional.all_to_all_single.default"),
                     (record.aot_graphs["backward"], "cp_passes.prefix_unpack.default"),
                     (record.aot_graphs["backward"], "cp_passes.prefix_finish_backward.default")):
        lines = tagged_lines(code, op)
        assert len(lines) == 2 and all("# cp_passes: pass=sequence_gather rule=sdpa_causal" in x for x in lines), lines


@given(world=st.integers(1, 8), local=st.integers(1, 12))
def test_layout_owns_every_position_once_and_round_trips(world, local):
    layout = Layout(world)
    seq = layout.global_len(local)
    owned = torch.cat([layout.positions(rank, local) for rank in range(world)])
    assert sorted(owned.tolist()) == list(range(seq))  # every global position exactly once
    assert torch.equal(layout.gathered_positions(local), owned)  # a gather is in rank order
    whole = torch.arange(seq)[None].expand(2, seq)
    for rank in range(world):
        positions = layout.positions(rank, local)
        assert torch.equal(layout.shard(whole, 1, rank), positions[None].expand(2, local))
        assert sum(stop - start for start, stop in layout.ranges(rank, local)) == local
        for i, p in enumerate(positions.tolist()):
            assert layout.owner(p, local) == (rank, i)
    with pytest.raises(IndexError):
        layout.owner(seq, local)


@given(world=st.integers(1, 8), local=st.integers(1, 12), halo=st.integers(0, 30))
def test_layout_halo_positions_are_the_positions_before_the_shard(world, local, halo):
    layout = Layout(world)
    for rank in range(world):
        before = layout.halo_positions(halo, rank, local)
        positions = layout.positions(rank, local)
        assert torch.equal(before[halo:], positions)
        assert torch.equal(before[:halo], positions[0] - halo + torch.arange(halo))
        assert int((before[:halo] < 0).sum()) == layout.leading_zeros(halo, rank, local)


def test_layout_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="kind"):
        Layout(4, "head_tail")
    with pytest.raises(ValueError, match="world"):
        Layout(0)


class ForgetsToWire(cp_passes.Transport):
    name, order = "toy_unwired", 37

    def apply(self, edit, request):
        edit.insert(torch.ops.aten.mul.Tensor, (request.node, 1), name="cp_toy_unused", before=request.node.next)


def test_an_edit_that_is_never_used_fails_verify(group, rule_asking_for, registered):
    """Inserting a node that nothing uses while the rewritten op still runs as before changes nothing."""
    registered(ForgetsToWire())
    rule_asking_for("toy_unwired")
    with pytest.raises(CPCompileError, match="planned rewrites were not applied: running_scale_carry"):
        compile_once(group, UsesRunningScale())


class MeanSquaredError(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, target):
        return nn.functional.mse_loss(self.proj(x), target)


def test_a_mean_over_float_targets_divides_by_an_integer_count_with_inductor(group):
    """The global count is an int64 on every path (its fake kernel says so), also for float targets; on the fake
    group the all-reduce returns this rank's count, so the result is this rank's mean."""
    torch.manual_seed(0)
    model = MeanSquaredError()
    x, target = torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    compiled = cp_passes.cp_compile(model, mesh=group, backend="inductor", verbose=False)
    loss = compiled(x, target)
    torch.testing.assert_close(loss, nn.functional.mse_loss(model.proj(x), target))
    (row,) = [r for r in compiled.compile_records[0].records if r.rule == "global_mean"]
    assert row.transport == "reductions"


class NoLayouts(cp_passes.Transport):
    name, order, layouts = "toy_no_layouts", 38, ()

    def apply(self, edit, request):
        raise AssertionError("planning refuses a transport that does not support the layout")


def test_a_transport_that_does_not_support_the_layout_is_refused_at_plan_time(group, rule_asking_for, registered):
    registered(NoLayouts())
    rule_asking_for("toy_no_layouts")
    with pytest.raises(CPCompileError, match="its transport 'toy_no_layouts' supports the layouts \\(\\), not "
                                             "the 'contiguous' layout"):
        compile_once(group, UsesRunningScale())
