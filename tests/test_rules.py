"""The rule table's extension points, as README documents them."""

import pytest
import torch
import torch.distributed as dist
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


@pytest.fixture(scope="module")
def group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    return dist.group.WORLD


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
    @cp_passes.register_rule(torch.ops.cp_passes_test.running_max.default)
    def _(ctx):
        ctx.require_not_along_sequence(ctx.arg("x"), ctx.arg("dim"), "takes a running max along")
        return None

    assert run(group, lambda x: running_max(x, 2)).shape == (2, 8, 8)
    with pytest.raises(CPCompileError, match="takes a running max along dim \\[1\\], the sequence axis"):
        run(group, lambda x: running_max(x, 1))
