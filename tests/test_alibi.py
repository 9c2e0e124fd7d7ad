"""Position biases on the key axis as transformers ships them. BLOOM: ALiBi attention written by hand on
``[batch * heads, S, S]`` (``alibi.baddbmm(q, k^T)``, the bias brought to the key axis with the keys) and an MLP
whose GeLU is a ``torch.autograd.Function`` with its own backward, declared position-wise in
``model_specs/bloom.py`` (``CPSpec.positionwise_functions``). MPT: ALiBi from a table of ``max_seq_len``
positions sliced to the keys' length from its end, read as this rank's rows of the table; learned absolute
position tables sliced so too. Parity on real gloo processes; declarations and refusals on the fake process
group."""

import pytest
import torch
import torch.nn as nn

import cp_passes
import hybrid_models
from hybrid_models import batch, build, reference
from parity import compare_valid


@pytest.mark.parametrize("P,seq_lens", [(2, [11]), pytest.param(2, [16], marks=pytest.mark.full),
                                        pytest.param(4, [16, 13], marks=pytest.mark.full)])
def test_bloom_matches_one_device(pool, parity_report, P, seq_lens):
    per_rank = pool.run(hybrid_models.parity, P, family="bloom", seq_lens=seq_lens)
    assert per_rank[0][0]["origin"] == "model_specs/bloom.py, picked by model_type 'bloom'"
    for i, seq_len in enumerate(seq_lens):
        compare_valid("hf-bloom-alibi", [r[i] for r in per_rank], reference("bloom", seq_len), seq_len, parity_report)


@pytest.mark.parametrize("family,P,seq_lens", [
    pytest.param("table_prefix", 2, [11], marks=pytest.mark.full),
    *[pytest.param(f, P, [16], marks=pytest.mark.full) for f in ("mpt", "table_suffix", "table_clamped_suffix")
      for P in (2, 4)],
    pytest.param("table_prefix", 4, [16, 13], marks=pytest.mark.full)])
def test_tables_sliced_to_the_sequence_length_match_one_device(pool, parity_report, family, P, seq_lens):
    """``table[:, :S]`` (a learned absolute position table; an odd length, padded), ``table[:, n - S:]`` and
    ``table[:, max(0, n - S):]`` (the same from its end), MPT's ALiBi table sliced from its end."""
    per_rank = pool.run(hybrid_models.parity, P, family=family, seq_lens=seq_lens)
    for i, seq_len in enumerate(seq_lens):
        compare_valid(f"{family}", [r[i] for r in per_rank], reference(family, seq_len), seq_len, parity_report)
        assert any(rule == "table_positions" for rule, *_ in per_rank[0][i]["records"])


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


class CumulativeSum(torch.autograd.Function):
    """A running sum over the sequence with its own backward (the reversed running sum of the gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.cumsum(1)

    @staticmethod
    def backward(ctx, grad):
        return grad.flip(1).cumsum(1).flip(1)


class NormalizedGradient(torch.autograd.Function):
    """Position-wise forward; the backward scales the gradient by its norm over the sequence."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad / grad.norm(dim=1, keepdim=True)


class Declared(nn.Module):
    """Calls the Function this module names (read at call time, as the declaration replaces it)."""

    def __init__(self, function: str):
        super().__init__()
        self.embed, self.function = nn.Embedding(32, 8), function

    def forward(self, input_ids):
        return _DECLARED[self.function](self.embed(input_ids)).pow(2).sum()


_DECLARED = {"CumulativeSum": lambda x: CumulativeSum.apply(x),
             "NormalizedGradient": lambda x: NormalizedGradient.apply(x)}
"""Each Function by name, read from the module when called (a declaration replaces the module's attribute)."""


@pytest.mark.parametrize("function", ["CumulativeSum", "NormalizedGradient"])
def test_a_function_declared_position_wise_that_mixes_positions_is_refused(group, function):
    """A running sum (0.59 to 0.99 off before), and a position-wise forward whose backward reads the whole
    sequence: run on random inputs cut in two, their outputs or gradients differ from the whole's."""
    spec = cp_passes.CPSpec(positionwise_functions=(f"{__name__}:{function}",))
    compiled = cp_passes.cp_compile(Declared(function), spec, mesh=group, backend="aot_eager",
                                    verbose=False)
    with pytest.raises(cp_passes.CPCompileError) as info:
        compiled(input_ids=torch.arange(8).expand(2, 8))
    (problem,) = info.value.problems
    assert problem.reason.startswith(f"it runs the autograd.Function {__name__}:{function}, which the spec declares "
                                     f"position-wise, but on random inputs cut in two"), problem.reason
    assert f"remove '{__name__}:{function}' from CPSpec.positionwise_functions" in problem.fix


def test_a_table_sliced_from_its_end_on_a_padded_batch_is_refused(group):
    """17 positions padded to 24: the slice from the end would start 7 rows earlier than on one device."""
    compiled = cp_passes.cp_compile(build("table_suffix"), mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(batch(17), group)
    with pytest.raises(cp_passes.CPCompileError, match="a table sliced from its end by the sequence length"):
        compiled(**local)


class SlicedByTwiceTheLength(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, 64, 4))

    def forward(self, x):
        s = x.shape[1]
        return (x + self.table[:, s:2 * s]).sum()


def test_a_table_sliced_from_another_function_of_the_length_is_refused(group):
    compiled = cp_passes.cp_compile(SlicedByTwiceTheLength(), mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(cp_passes.CPCompileError, match="neither a constant nor a constant minus the length"):
        compiled(torch.randn(2, 4, 4))


def test_a_positionwise_function_declaration_is_checked():
    with pytest.raises(ValueError, match="'package.module:Class'"):
        cp_passes.CPSpec(positionwise_functions=("RoundStraightThrough",))
    with pytest.raises(ValueError, match="not a torch.autograd.Function subclass"):
        cp_passes.functions.install(("torch.nn:Linear",))


def test_gpt2_with_labels_matches_one_device(pool, parity_report):
    """transformers' GPT-2 as it ships, called with labels=: its loss_function logs a warning inside the forward,
    which dynamo cannot trace; cp_compile traces logging calls as no-ops, as torch.export does."""
    per_rank = pool.run(hybrid_models.parity, 2, family="gpt2", seq_lens=[14])
    compare_valid("hf-gpt2", [r[0] for r in per_rank], reference("gpt2", 14), 14, parity_report)
    assert {"arange_positions", "sdpa_causal"} <= {rule for rule, *_ in per_rank[0][0]["records"]}
