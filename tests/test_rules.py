"""The rule table's extension points, as README documents them."""

import re

import pytest
import torch
import torch.nn as nn

import cp_passes
from cp_passes import CPCompileError


@torch.library.custom_op("cp_passes_test::scale_rows", mutates_args=())
def scale_rows(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@scale_rows.register_fake
def _(x, factor):
    return torch.empty_like(x)


@torch.library.custom_op("cp_passes_test::running_max", mutates_args=())
def running_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.cummax(dim).values


@running_max.register_fake
def _(x, dim):
    return torch.empty_like(x)


class UsesOp(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.embed = nn.Embedding(32, 8).requires_grad_(False)  # the test ops have no autograd formula
        self.op = op

    def forward(self, ids):
        return self.op(self.embed(ids))


def run(group, op):
    compiled = cp_passes.cp_compile(UsesOp(op), mesh=group, backend="aot_eager", verbose=False)
    return compiled(torch.randint(0, 32, (2, 8)))


def test_unknown_op_on_the_sequence_is_refused_then_declared_positionwise(group):
    with pytest.raises(CPCompileError) as info:
        run(group, lambda x: scale_rows(x, 2.0))
    problem = info.value.problems[0]
    assert problem.op == "cp_passes_test.scale_rows.default" and "no rule" in problem.reason
    assert "cp_passes.positionwise(op)" in problem.fix
    cp_passes.positionwise(torch.ops.cp_passes_test.scale_rows)
    assert run(group, lambda x: scale_rows(x, 2.0)).shape == (2, 8, 8)


def test_a_registered_rule_can_accept_or_refuse_by_dim(group):
    @cp_passes.register_rule(torch.ops.cp_passes_test.running_max.default, replace=True)  # this test's own
    def _(ctx):
        ctx.require_not_along_sequence(ctx.arg("x"), ctx.arg("dim"), "takes a running max along")
        return None

    assert run(group, lambda x: running_max(x, 2)).shape == (2, 8, 8)
    with pytest.raises(CPCompileError, match="takes a running max along dim \\[1\\], the sequence axis"):
        run(group, lambda x: running_max(x, 1))

    # a second rule for the op is refused unless it says it replaces the first
    with pytest.raises(ValueError, match="already has a rule .*replace=True"):
        cp_passes.register_rule(torch.ops.cp_passes_test.running_max.default)(lambda ctx: None)
    cp_passes.register_rule(torch.ops.cp_passes_test.running_max.default, replace=True)(lambda ctx: None)
    assert run(group, lambda x: running_max(x, 1)).shape == (2, 8, 8)


def test_in_place_ops_follow_the_rule_of_their_out_of_place_op(group):
    """masked_fill_ and __iand__ carry no pointwise tag; they take masked_fill's and __and__'s rules."""
    from cp_passes.rules import lookup_rule
    from cp_passes.rules.registry import out_of_place

    aten = torch.ops.aten
    assert out_of_place(aten.masked_fill_.Scalar) is aten.masked_fill.Scalar
    assert out_of_place(aten.__iand__.Tensor) is aten.__and__.Tensor
    assert lookup_rule(aten.masked_fill_.Scalar) is lookup_rule(aten.masked_fill.Scalar) is not None
    assert lookup_rule(aten.cumsum_.default) is lookup_rule(aten.cumsum.default)

    def fill_in_place(x):
        x = x.clone()
        x.masked_fill_(x > 0, 0.0)
        return x

    assert run(group, fill_in_place).shape == (2, 8, 8)
    with pytest.raises(CPCompileError, match="in-place form of aten.cumsum.default, which needs the scan transport"):
        run(group, lambda x: x.clone().cumsum_(1))


def test_a_mutation_another_reader_would_see_is_refused(group):
    """A view taken before `band &= ...` sees the mutation; the planner reads values, so it refuses."""
    def view_then_mutate(x):
        s = x.shape[1]
        distance = torch.arange(s)[:, None] - torch.arange(s)[None, :]
        band = distance >= 0
        seen = band[None, None]
        band &= distance < 3
        q = x.view(2, s, 2, 4).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=seen).transpose(1, 2).flatten(2)

    read = r"mutates 'band = distance >= 0' at tests/test_rules.py:\d+ in place, which is also read by aten.unsqueeze"
    with pytest.raises(CPCompileError, match=read):
        run(group, view_then_mutate)


def test_scattering_positions_into_a_tensor_without_the_sequence_is_refused(group):
    with pytest.raises(CPCompileError, match="scatters per-position values into a tensor without the sequence"):
        run(group, lambda x: torch.zeros(8).index_add_(0, (x[..., 0] > 0).long().flatten(), x[..., 1].flatten()))


@pytest.mark.parametrize("inner", [True, False], ids=["copies_inner", "copies_outer"])
def test_repeat_interleave_along_the_sequence_keeps_the_copies_inner(group, inner):
    """repeat_interleave(2, dim) on [batch * seq] (MoE dispatch) is position-wise only while later views keep the
    copies as the inner factor."""
    def repeat_then_split(x):
        b, s, h = x.shape
        rows = x.flatten(0, 1).repeat_interleave(2, 0)
        summed = rows.view(b * s, 2, h).sum(1) if inner else rows.view(2, b * s, h).sum(0)
        return summed.view(b, s, h)

    ok = inner

    if ok:
        assert run(group, repeat_then_split).shape == (2, 8, 8)
    else:
        with pytest.raises(CPCompileError, match="splits that axis with the copies as the outer factor"):
            run(group, repeat_then_split)


def test_a_shift_reads_its_source_before_a_later_mutation(group):
    def pad_mutate_slice(x):
        x = x.clone()
        padded = torch.nn.functional.pad(x, (0, 0, 1, 0))
        x.mul_(2)
        return padded[:, :x.shape[1]] + x

    compiled = cp_passes.cp_compile(UsesOp(pad_mutate_slice), mesh=group, backend="aot_eager", verbose=False)
    compiled(torch.randint(0, 32, (2, 8)))
    names = [m.group(1) for line in compiled.compile_records[0].history[-1][1].splitlines()
             if (m := re.match(r"\s+(\w+)(?::[^=]*)? = ", line))]
    assert names.index("cp_shifted") < next(i for i, n in enumerate(names) if n.startswith("mul_"))
