"""No rank is left waiting: when one rank fails or diverges, every rank raises, before any graph collective.

Real gloo processes; the last rank is the odd one out. A hang fails the test after HANG_S seconds (the pool
is then replaced). P = 4 runs with the full matrix (``-m full``)."""

import pytest
import torch
import torch.nn.functional as F

import cp_passes
from shared import Mixer, envelope_violation, error_text, mixer_batch, toy_batch, toy_model


class PrefixLM(torch.nn.Module):
    """Attention written by hand with a prefix-LM mask: prompt tokens (doc id 1) see each other both ways,
    the rest causally. For one document it is causal, so cp_passes brings the causal prefix and checks the
    mask each step."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, input_ids, doc_ids):
        x = self.embed(input_ids)
        pos = torch.arange(x.shape[1])
        prompt = doc_ids == 1
        allowed = (pos[None, :, None] >= pos[None, None, :]) | (prompt[:, :, None] & prompt[:, None, :])
        out = self.proj((x @ x.transpose(1, 2)).masked_fill(~allowed, float("-inf")).softmax(-1) @ x)
        return out.pow(2).sum(), out


def prefix_lm(group, prompt: int, attention_keys: str) -> dict:
    """PrefixLM on 8 tokens whose first ``prompt`` are the prompt: this rank's outputs, or the error."""
    torch.manual_seed(0)
    model = PrefixLM()
    spec = cp_passes.CPSpec(attention_keys=attention_keys)
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend="aot_eager", verbose=False)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    doc_ids = (torch.arange(8) < prompt).long().expand(2, 8)
    local, layout = cp_passes.shard_batch({"input_ids": ids, "doc_ids": doc_ids}, group, spec)
    outputs = []
    error = error_text(lambda: outputs.append(compiled(**local)[1].detach()))
    return {"error": error, "out": outputs[0] if outputs else None, "want": model(ids, doc_ids)[1].detach(),
            "positions": layout.positions}


class MarkedKeyAttention(torch.nn.Module):
    """SDPA over token embeddings with a mask read from the token ids: causal, and every query also sees token
    31 wherever it stands, later keys included. For one document without that token it is causal."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)

    def forward(self, input_ids):
        x = self.embed(input_ids)[:, None]
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        mask = (pos[:, None] >= pos[None, :]) | (input_ids[:, None, :] == 31)
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask[:, None])[:, 0].square().sum()


class BreaksOnSomeRanks(torch.nn.Module):
    """ToyLlama whose forward has a graph break where ``breaks`` is set: those ranks cannot compile."""

    def __init__(self, breaks: bool):
        super().__init__()
        self.toy = toy_model()
        self.breaks = breaks

    def forward(self, input_ids):
        if self.breaks:
            torch._dynamo.graph_break()
        return self.toy(input_ids)


class Scaled(torch.nn.Module):
    """ToyLlama's logits times a Python float: dynamo guards on its value."""

    def __init__(self):
        super().__init__()
        self.toy = toy_model()
        self.factor = 1.0

    def forward(self, input_ids):
        return self.toy(input_ids) * self.factor

HANG_S = 240
OUTSIDE_THE_PREFIX = "the model's attention mask lets a query see a key outside the causal prefix in this batch"
WORLDS = [2, pytest.param(4, marks=pytest.mark.full)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("change", ["length", pytest.param("rows", marks=pytest.mark.full),
                                    pytest.param("dtype", marks=pytest.mark.full)])
def test_inputs_that_differ_across_ranks_fail_on_every_rank(pool, world, change):
    """The second call reuses rank 0's compiled graph; before, only the first call of a length was checked,
    so rank 0 entered the graph's all-gather while the last rank waited in the check (or gloo aborted)."""
    local, last = 16 // world, world - 1
    differs = {
        "length": f"rank {last} has input_ids: (2, {2 * local}) torch.int64, rank 0 has input_ids: (2, {local})",
        "rows": f"rank {last} has input_ids: (1, {local}) torch.int64, rank 0 has input_ids: (2, {local})",
        "dtype": f"rank {last} has position_ids: (2, {local}) torch.int32, rank 0 has position_ids: (2, {local}) "
                 f"torch.int64",
    }[change]
    errors = pool.run(diverging_inputs, world, timeout=HANG_S, change=change)
    for error in errors:
        assert error.startswith("ValueError: the CP ranks were called with different inputs"), error
        assert differs in error, error


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_that_cannot_compile_stops_every_rank(pool, world):
    errors = pool.run(compile_fails_on_one_rank, world, timeout=HANG_S)
    assert errors[-1].startswith("CPCompileError: cp_passes needs the whole forward as one graph"), errors[-1]
    for error in errors[:-1]:
        assert error.startswith(f"CPCompileError: rank {world - 1} failed to compile, so no rank runs this "
                                f"graph"), error
        assert "graph_break" in error


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_that_recompiles_alone_stops_every_rank(pool, world):
    """Guards that hold on some ranks only: before, the last rank compiled while the others ran their cached
    graph's collectives without it."""
    errors = pool.run(recompile_on_one_rank, world, timeout=HANG_S)
    reused = list(range(world - 1))
    for error in errors:
        assert error.startswith(f"CPCompileError: ranks [{world - 1}] compiled a new graph for this call while "
                                f"ranks {reused} reuse the graph they have"), error
        assert "factor" in error, error


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_that_plan_different_collectives_stop_before_running(pool, world):
    errors = pool.run(schedules_differ, world, timeout=HANG_S)
    for error in errors:
        assert "planned different collective schedules" in error, error
        assert "collective #1 is cp_passes::halo(" in error and "but prefix_start(" in error, error


@pytest.mark.parametrize("world", WORLDS)
def test_a_mask_leaving_the_window_in_some_ranks_rows_fails_on_every_rank(pool, world):
    """The first half of the rows are documents of two tokens (inside the declared window of 2), the second
    half one document of four. Each rank checks every row of the global mask, so all stop at the same step."""
    errors = pool.run(envelope_violation, world, timeout=HANG_S, layout=[[(2, 2), (2, 2), (4, 4)]])
    for error in errors:
        assert "lets a query see a key outside the window of 2 in this batch" in error, error


def test_a_mask_from_activations_that_shows_later_keys_fails_on_every_rank(pool):
    """A boolean mask computed from activations carries no gradient, so it is evaluated from the gathered
    activations at this rank's rows; SDPA then brings the causal prefix, and this mask lets queries see later
    keys. Each rank counts the later keys its transposed block allows; the all-reduced count stops every rank."""
    for error in pool.run(mixer_error, 2, timeout=HANG_S, mix="both_ways_activation_mask", seq_len=8):
        assert OUTSIDE_THE_PREFIX in error, error


@pytest.mark.parametrize("world", WORLDS)
def test_a_later_key_only_the_last_rank_holds_fails_on_every_rank(pool, world):
    """SDPA's mask lets every query see token 31, which stands only in the last rank's shard. Each rank
    evaluates the mask at its own rows and checks the transposed block (the keys it holds against the queries
    before them); only the last rank finds the later key, and the all-reduced count stops every rank. Without
    the token the same model runs."""
    for error in pool.run(marked_key_error, world, timeout=HANG_S, seq_len=16, at=15):
        assert OUTSIDE_THE_PREFIX in error, error
    assert pool.run(marked_key_error, world, timeout=HANG_S, seq_len=16, at=None) == ["no error"] * world


def test_a_mask_that_shows_later_keys_for_some_data_fails_on_every_rank(pool):
    """A prefix-LM mask is causal for one document, so its hand-written attention brings the causal prefix; a
    prompt of 6 tokens (across both ranks) lets rank 0's queries see rank 1's keys. The run-time check over the
    whole mask stops every rank, and attention_keys='all' (the fix it names) gives the single-device result."""
    for result in pool.run(prefix_lm, 2, timeout=HANG_S, prompt=6, attention_keys="visible"):
        assert "outside the causal prefix in this batch" in result["error"], result["error"]
        assert "attention_keys='all'" in result["error"]
    for result in pool.run(prefix_lm, 2, timeout=HANG_S, prompt=6, attention_keys="all"):
        assert result["error"] == "no error", result["error"]
        torch.testing.assert_close(result["out"], result["want"][:, result["positions"]])


class _Flips(torch.nn.Module):
    """Blocks that reverse and roll the sequence: two problems, each in every block."""

    def __init__(self, blocks: int = 3):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.layers = torch.nn.ModuleList(_Flip() for _ in range(blocks))

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x


class _Flip(torch.nn.Module):
    def forward(self, x):
        return torch.roll(x.flip(1), 1, dims=1)


def refused_everywhere(group) -> tuple[str, int]:
    """Every rank refuses the same model: its message and how many problems it carries."""
    import cp_passes

    compiled = cp_passes.cp_compile(_Flips(), mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch({"input_ids": torch.randint(0, 32, (2, 16))}, group)
    try:
        compiled(**local)
    except cp_passes.CPCompileError as error:
        return f"{type(error).__name__}: {error}", len(error.problems)
    return "no error", 0


@pytest.mark.parametrize("P", [2, pytest.param(4, marks=pytest.mark.full)])
def test_a_refusal_every_rank_finds_prints_once_each_problem_once(pool, P):
    """The list is printed by rank 0 alone, each distinct problem once with the blocks it occurs in; the other
    ranks point there and keep the problems for code that reads them."""
    (first, count), *others = pool.run(refused_everywhere, P, timeout=HANG_S)
    assert count == 6 and all(also == 6 for _, also in others)
    assert first.startswith("CPCompileError: cp_passes cannot shard this model along the sequence (2 problems, at "
                            "6 places):"), first
    assert first.count("aten.flip.default at ") == 1 and first.count("aten.roll.default at ") == 1, first
    assert first.count("(in 3 modules: layers.0, layers.1, layers.2)") == 2, first
    pointer = (f"CPCompileError: rank 0 prints why this model cannot be sharded (2 problems, at 6 places; ranks "
               f"{list(range(P))} found the same)")
    assert all(second == pointer for second, _ in others), others


# Tasks the worker pool's ranks run (pool.run(task, P, ...)).


def mixer_error(group, mix: str, seq_len: int) -> str:
    """The error of one step of Mixer(mix) under CP (or "no error")."""
    torch.manual_seed(0)
    compiled = cp_passes.cp_compile(Mixer(mix), mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(mixer_batch(seq_len), group)
    return error_text(lambda: compiled(**local))


def marked_key_error(group, seq_len: int, at: int | None) -> str:
    """The error of one step of MarkedKeyAttention under CP when token 31 stands at position ``at`` only (or
    nowhere): only the rank holding that key finds the queries before it that see it."""
    torch.manual_seed(0)
    compiled = cp_passes.cp_compile(MarkedKeyAttention(), mesh=group, backend="aot_eager", verbose=False)
    ids = torch.arange(seq_len).remainder(30).expand(2, seq_len).clone()
    if at is not None:
        ids[:, at] = 31
    local, _ = cp_passes.shard_batch({"input_ids": ids}, group)
    return error_text(lambda: compiled(**local).backward())


def diverging_inputs(group, change: str) -> str:
    """One call with the same inputs everywhere (it compiles), then one where the last rank's inputs differ:
    a longer shard (``length``), another batch size (``rows``) or int32 positions (``dtype``)."""
    compiled = cp_passes.cp_compile(toy_model(), mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(toy_batch(16), group)
    inputs = {"input_ids": local["input_ids"], "position_ids": local["position_ids"]}
    compiled(**inputs)
    if group.rank() == group.size() - 1:
        if change == "length":
            inputs = {k: torch.cat([v, v], dim=1) for k, v in inputs.items()}
        elif change == "rows":
            inputs = {k: v[:1] for k, v in inputs.items()}
        else:
            inputs["position_ids"] = inputs["position_ids"].int()
    return error_text(lambda: compiled(**inputs))


def recompile_on_one_rank(group) -> str:
    """After a first call everywhere, only the last rank changes a guarded value: it compiles a new graph while
    the others would reuse theirs and issue their collectives alone."""
    model = Scaled()
    compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch({"input_ids": toy_batch(16)["input_ids"]}, group)
    compiled(**local)
    if group.rank() == group.size() - 1:
        model.factor = 2.0
    return error_text(lambda: compiled(**local))


def compile_fails_on_one_rank(group) -> str:
    """The last rank cannot compile; the others compile fine and must not enter the graph's collectives."""
    model = BreaksOnSomeRanks(breaks=group.rank() == group.size() - 1)
    compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch({"input_ids": toy_batch(16)["input_ids"]}, group)
    return error_text(lambda: compiled(**local))


def schedules_differ(group) -> str:
    """The last rank's model has a sliding window (a halo) where the others gather their causal prefix."""
    window = 3 if group.rank() == group.size() - 1 else None
    compiled = cp_passes.cp_compile(toy_model(window=window), mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch({"input_ids": toy_batch(16)["input_ids"]}, group)
    return error_text(lambda: compiled(**local))
