"""BLOOM as transformers ships it: ALiBi attention written by hand on ``[batch * heads, S, S]``
(``alibi.baddbmm(q, k^T)``, the bias brought to the key axis with the keys) and an MLP whose GeLU is a
``torch.autograd.Function`` with its own backward, declared position-wise in ``model_specs/bloom.py``
(``CPSpec.positionwise_functions``). Parity on real gloo processes; the Function's declaration on the fake
process group."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import cp_passes

from hybrid_models import reference
from test_parity import compare_valid


@pytest.mark.parametrize("P,seq_lens", [(2, [11]), pytest.param(2, [16], marks=pytest.mark.full),
                                        pytest.param(4, [16, 13], marks=pytest.mark.full)])
def test_bloom_matches_one_device(pool, parity_report, P, seq_lens):
    per_rank = pool.run("hybrid_models:parity", P, family="bloom", seq_lens=seq_lens)
    assert per_rank[0][0]["origin"] == "model_specs/bloom.py, picked by model_type 'bloom'"
    for i, seq_len in enumerate(seq_lens):
        compare_valid("hf-bloom-alibi", [r[i] for r in per_rank], reference("bloom", seq_len), seq_len, parity_report)


class RoundStraightThrough(torch.autograd.Function):
    """Rounds forward, passes the gradient through unchanged backward: autograd of the forward would give 0."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class FloorStraightThrough(RoundStraightThrough):
    @staticmethod
    def forward(ctx, x):
        return torch.floor(x * 4) / 4


class Quantized(nn.Module):
    def __init__(self, floor: bool = False):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.floor = floor

    def forward(self, input_ids):
        function = FloorStraightThrough if self.floor else RoundStraightThrough
        return function.apply(self.embed(input_ids)).pow(2).sum()


@pytest.fixture(scope="module")
def group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)  # as the other fake-group tests
    return dist.group.WORLD


def test_a_declared_function_runs_its_own_backward(group):
    spec = cp_passes.CPSpec(positionwise_functions=(f"{__name__}:RoundStraightThrough",))
    torch.manual_seed(0)
    model = Quantized()
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend="aot_eager", verbose=False)
    ids = torch.arange(4).expand(2, 4)
    compiled(input_ids=ids).backward()
    rounded = torch.round(model.embed.weight[:4].detach() * 4) / 4
    assert torch.equal(model.embed.weight.grad[:4], 2 * 2 * rounded)  # d(y^2)/dy, passed straight through, twice
    assert not model.embed.weight.grad[4:].any()


def test_an_undeclared_function_is_refused_naming_the_declaration(group):
    """Never declared: refused at capture. Declared by another cp_compile in the process (the module attribute
    is replaced for the process): refused by the spec that does not declare it."""
    compiled = cp_passes.cp_compile(Quantized(floor=True), cp_passes.CPSpec(), mesh=group, backend="aot_eager",
                                    verbose=False)
    with pytest.raises(cp_passes.CPCompileError, match=r"positionwise_functions=\('package.module:Class',\)"):
        compiled(input_ids=torch.arange(4).expand(2, 4))
    declared = cp_passes.CPSpec(positionwise_functions=(f"{__name__}:RoundStraightThrough",))
    cp_passes.cp_compile(Quantized(), declared, mesh=group, backend="aot_eager", verbose=False)
    compiled = cp_passes.cp_compile(Quantized(), cp_passes.CPSpec(), mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(cp_passes.CPCompileError, match="which this spec does not declare position-wise"):
        compiled(input_ids=torch.arange(4).expand(2, 4))


def test_a_positionwise_function_declaration_is_checked():
    with pytest.raises(ValueError, match="'package.module:Class'"):
        cp_passes.CPSpec(positionwise_functions=("RoundStraightThrough",))
    with pytest.raises(ValueError, match="not a torch.autograd.Function subclass"):
        cp_passes.functions.install(("torch.nn:Linear",))
