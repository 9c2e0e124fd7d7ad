"""Grouped sequence axes: a model that splits the sequence into windows of m positions (``[B, S, D] ->
[B, S / m, m, D]``, as DeepSeek V4's compressors do) runs locally when every shard holds whole windows
(``CPSpec.pad_multiple``), and the windows' positions become global. Parity on real gloo processes;
refusals and the batch side on the fake process group."""

import pytest
import torch

import cp_passes
from cp_passes import CPCompileError
from cp_passes.data.batch import shard_for_rank
from cp_passes.layout import Layout
from parity import GRAD_RTOL, OUT_TOL, compare_small
from shared import in_global_order, mixer_batch, small_parity, step_result


class Compressor(torch.nn.Module):
    """DeepSeek V4's compressor of heavily compressed attention (transformers' DeepseekV4HCACompressor) on
    token embeddings: windows of 4 positions pooled by a learned softmax gate into one entry each, rotated
    at the window's global position. Returns the sum of squares of the entries and the entries."""

    def __init__(self):
        super().__init__()
        from transformers import DeepseekV4Config
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ds

        config = DeepseekV4Config(vocab_size=32, hidden_size=16, head_dim=8, num_hidden_layers=1, q_lora_rank=8,
                                  compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4})
        self.embed = torch.nn.Embedding(32, 16)
        self.compressor = ds.DeepseekV4HCACompressor(config)
        torch.nn.init.normal_(self.compressor.position_bias)

    def forward(self, input_ids, position_ids):
        entries, _ = self.compressor(self.embed(input_ids), None, position_ids, None, 0)
        return entries.pow(2).sum(), entries


COMPRESSOR_SPEC = cp_passes.CPSpec(name="compressor", pad_multiple=4)


def compressor_batch(seq_len: int) -> dict:
    ids = torch.randint(0, 32, (2, seq_len), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "position_ids": torch.arange(seq_len).expand(2, seq_len)}


class OverlappingWindows(torch.nn.Module):
    """The window pairing of DeepSeek V4's CSA compressor, as transformers writes it: each position projects
    to two halves; entry ``w`` pools window ``w``'s second halves with window ``w - 1``'s first halves (written
    into rows ``1:`` of a fresh tensor; window 0's slots stay zero with a -inf gate). Windows of 2."""

    def __init__(self, ratio: int = 2, dim: int = 8):
        super().__init__()
        self.ratio, self.dim = ratio, dim
        self.embed = torch.nn.Embedding(32, 16)
        self.kv_proj = torch.nn.Linear(16, 2 * dim, bias=False)
        self.gate_proj = torch.nn.Linear(16, 2 * dim, bias=False)
        self.position_bias = torch.nn.Parameter(torch.randn(ratio, 2 * dim))

    def forward(self, input_ids, position_ids):
        h = self.embed(input_ids)
        batch, ratio, dim = h.shape[0], self.ratio, self.dim
        n_windows = h.shape[1] // ratio
        kv = self.kv_proj(h).view(batch, n_windows, ratio, -1)
        gate = self.gate_proj(h).view(batch, n_windows, ratio, -1) + self.position_bias
        new_kv = kv.new_zeros((batch, n_windows, 2 * ratio, dim))
        new_gate = gate.new_full((batch, n_windows, 2 * ratio, dim), float("-inf"))
        new_kv[:, :, ratio:] = kv[..., dim:]
        new_gate[:, :, ratio:] = gate[..., dim:]
        new_kv[:, 1:, :ratio] = kv[:, :-1, :, :dim]
        new_gate[:, 1:, :ratio] = gate[:, :-1, :, :dim]
        entries = (new_kv * new_gate.softmax(dim=2)).sum(dim=2)
        return entries.pow(2).sum(), entries


class ShiftedWrite(torch.nn.Module):
    """A token shift written into a fresh tensor: ``prev[:, 1:] = h[:, :-1]`` (zeros at the first position)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.mix = torch.nn.Linear(16, 8)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        prev = h.new_zeros(h.shape)
        prev[:, 1:] = h[:, :-1]
        out = self.mix(torch.cat([h, prev], -1))
        return out.pow(2).sum(), out


@pytest.mark.parametrize("P", [2, pytest.param(4, marks=pytest.mark.full)])
def test_compressed_entries_match_one_device(pool, P):
    """transformers' heavily-compressed-attention compressor, windows of 4, two per rank (a rank holding a
    single window would let the tracer specialize the window count to 1). Entries (rotated at their global
    window positions) and gradients match one device; nothing moves between ranks."""
    seq_len = 8 * P
    per_rank = pool.run(compressor_parity, P, seq_len=seq_len)
    torch.manual_seed(0)
    model = Compressor()
    loss, out = model(**compressor_batch(seq_len))
    loss.backward()
    entries = in_global_order(per_rank, "logits", dim=2)  # [batch, 1, windows, head_dim]
    assert entries.shape == out.shape == (2, 1, seq_len // 4, 8)
    assert (entries - out.detach()).abs().max().item() <= OUT_TOL
    assert abs(sum(r["loss"] for r in per_rank).item() - loss.item()) <= OUT_TOL * abs(loss.item())
    for name, p in model.named_parameters():
        total = sum(r["grads"][name] for r in per_rank)
        assert ((total - p.grad).abs().max() / p.grad.abs().max()).item() <= GRAD_RTOL, name
    for results in per_rank:
        rules = {(rule, transport, moved) for rule, transport, moved, _ in results["records"]}
        assert ("arange_positions", "positions", 0) in rules, rules
        assert all(moved == 0 for _, _, moved in rules), rules


def _compile(model, spec, group, seq_len):
    compiled = cp_passes.cp_compile(model, spec, mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(compressor_batch(seq_len), group, spec)
    return compiled, local


def test_windows_without_a_pad_multiple_are_refused_naming_it(group):
    compiled, local = _compile(Compressor(), cp_passes.CPSpec(), group, 64)
    with pytest.raises(CPCompileError, match=r"modeling_deepseek_v4.py:\d+ .*\n.*splitting it into chunks.*\n.*"
                                             r"CPSpec\(pad_multiple=4\)"):
        compiled(**local)


def test_a_shard_of_partial_windows_is_refused_before_compiling(group):
    compiled = cp_passes.cp_compile(Compressor(), COMPRESSOR_SPEC, mesh=group, backend="aot_eager", verbose=False)
    local, _ = cp_passes.shard_batch(compressor_batch(64), group)  # no spec: shards of 8 + 2 positions
    local = {k: v[:, :6] for k, v in local.items()}
    with pytest.raises(ValueError, match="local sequence length 6 is not a multiple of spec 'compressor'"):
        compiled(**local)


def test_shard_batch_pads_to_the_spec_multiple():
    """22 positions over 2 ranks with pad_multiple 4: padded to 24 (shards of 12 = 3 windows) on contiguous
    shards, to 32 on balanced ones (4 chunks of 2 windows); packed documents of 5 and 6 aligned to the spec's
    packed_alignment 4 start at 0 and 8."""
    batch = compressor_batch(22)
    local, layout = shard_for_rank(batch, 1, 2, COMPRESSOR_SPEC.replace(layout="contiguous"))
    assert layout.padded_len == 24 and local["input_ids"].shape == (2, 12)
    local, layout = shard_for_rank(batch, 1, 2, COMPRESSOR_SPEC)
    assert layout.padded_len == 32 and local["input_ids"].shape == (2, 16)
    spec = COMPRESSOR_SPEC.replace(packed_alignment=4)
    packed = {"input_ids": batch["input_ids"][:, :11], "seq_lens": torch.tensor([[5, 6], [5, 6]])}
    whole, _ = shard_for_rank(packed, 0, 1, spec)
    assert whole["doc_ids"][0].tolist() == [0] * 5 + [-1] * 3 + [1] * 6 + [-1] * 2, whole["doc_ids"]


def _matches_one_device(model, batch, results_by_rank, dim) -> None:
    loss, out = model(**batch)
    loss.backward()
    got = in_global_order(results_by_rank, "logits", dim)
    assert got.shape == out.shape
    assert (got - out.detach()).abs().max().item() <= OUT_TOL
    assert abs(sum(r["loss"] for r in results_by_rank).item() - loss.item()) <= OUT_TOL * abs(loss.item())
    for name, p in model.named_parameters():
        total = sum(r["grads"][name] for r in results_by_rank)
        assert ((total - p.grad).abs().max() / p.grad.abs().max()).item() <= GRAD_RTOL, name


def _ranges_read_from_another_rank(P: int, rank: int) -> int:
    """How many of ``rank``'s ranges (default spec: balanced) start after a range another rank holds."""
    layout = Layout(P, "balanced")
    owner = {c: r for r in range(P) for c in layout.chunk_indices(r)}
    return sum(c > 0 and owner[c - 1] != rank for c in layout.chunk_indices(rank))


@pytest.mark.parametrize("P", [2, pytest.param(4, marks=pytest.mark.full)])
def test_windows_paired_with_the_previous_one_take_a_halo_of_one_window(pool, P):
    """DeepSeek V4's CSA pairing (window w pools window w - 1's first halves, written into rows 1: of a
    fresh tensor) becomes a shift of one window: each rank but the first receives, for the values and for
    the gates, exactly the first halves of the previous rank's last window (batch 2 x 2 positions x 8 x 4 B),
    and rank 0's first entry keeps the zero / -inf slots. Three lengths: the first (two windows a rank, so
    one row to copy) gets a graph dynamo guards to that length, and one more graph serves the others."""
    seq_lens = [4 * P, 8 * P, 12 * P]
    per_rank = pool.run(overlapping_windows_parity, P, seq_lens=seq_lens)
    for i, seq_len in enumerate(seq_lens):
        torch.manual_seed(0)
        _matches_one_device(OverlappingWindows(), compressor_batch(seq_len), [r[i] for r in per_rank], 1)
    for rank, results in enumerate(per_rank):
        for result in results:
            shifts = [moved for rule, _, moved, _ in result["records"] if rule == "shift_stencil"]
            assert shifts == [2 * 2 * 8 * 4 * _ranges_read_from_another_rank(P, rank)] * 2, shifts
        assert [r["compiles"] for r in results] == [1, 2, 2], results


def test_a_token_shift_written_into_a_fresh_tensor_matches_one_device(pool):
    """``prev[:, 1:] = h[:, :-1]`` along positions: each rank but the first receives one row, at every
    length, from one graph."""
    seq_lens = [8, 12]
    per_rank = pool.run(shifted_write_parity, 2, seq_lens=seq_lens)
    for i, seq_len in enumerate(seq_lens):
        torch.manual_seed(0)
        _matches_one_device(ShiftedWrite(), {"input_ids": mixer_batch(seq_len)["input_ids"]},
                            [r[i] for r in per_rank], 1)
    for rank, results in enumerate(per_rank):
        for result in results:
            shifts = [moved for rule, _, moved, _ in result["records"] if rule == "shift_stencil"]
            assert shifts == [2 * 8 * 4 * _ranges_read_from_another_rank(2, rank)], shifts


class Regrouped(torch.nn.Module):
    """Positions grouped by 4 other than as windows of consecutive positions."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.embed = torch.nn.Embedding(32, 8)

    def forward(self, input_ids, position_ids):
        h = self.embed(input_ids)
        b, s = h.shape[:2]
        if self.how == "strided":  # positions i * S / 4 + j together: the window axis inner
            out = h.view(b, 4, s // 4, 8).sum(1)
        else:  # windows with the in-window axis moved in front, merged back: positions reordered
            out = h.view(b, s // 4, 4, 8).transpose(1, 2).reshape(b, s, 8)
        return out.pow(2).sum(), out


@pytest.mark.parametrize("how", ["strided", pytest.param("transposed", marks=pytest.mark.full)])
def test_positions_grouped_other_than_in_windows_are_refused(group, how):
    compiled, local = _compile(Regrouped(how), COMPRESSOR_SPEC, group, 64)
    with pytest.raises(CPCompileError, match="other than as windows of consecutive positions"):
        compiled(**local)


# Tasks the worker pool's ranks run (pool.run(task, P, ...)).


def compressor_parity(group, seq_len: int) -> dict:
    torch.manual_seed(0)
    model = Compressor()
    compiled = cp_passes.cp_compile(model, COMPRESSOR_SPEC, mesh=group, backend="aot_eager", verbose=False)
    local, layout = cp_passes.shard_batch(compressor_batch(seq_len), group, COMPRESSOR_SPEC)
    loss, out = compiled(**local)
    loss.backward()
    return step_result(model, compiled, loss, out, layout)


def overlapping_windows_parity(group, seq_lens: list[int]) -> list[dict]:
    """OverlappingWindows under CP at each length in turn (one compiled model): this rank's results, each
    with the number of graphs compiled so far."""
    torch.manual_seed(0)
    return small_parity(group, OverlappingWindows(), cp_passes.CPSpec(name="overlap", pad_multiple=2), seq_lens,
                        batch=compressor_batch)


def shifted_write_parity(group, seq_lens: list[int]) -> list[dict]:
    torch.manual_seed(0)
    return small_parity(group, ShiftedWrite(), None, seq_lens)


@pytest.mark.parametrize("widths", [(1, -1), (-1, 1), (-2, -1), (0, -3), (2, -1), (-1, 0, 1, -2)])
def test_a_pad_that_crops_is_the_same_value_as_a_pad_and_a_slice(widths):
    """RWKV's time shift pads with a negative width (``nn.ZeroPad2d((0, 0, 1, -1))``); cp_passes rewrites such a
    pad as a pad of the widths that are not negative and a slice of each cropped dim, which the shift rule reads.
    The rewritten graph computes the same tensor for crops at either end, both, and of two dims."""
    import functools

    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    from cp_passes.graph.shifted_writes import cropping_pads_as_slices

    x = torch.randn(3, 7, 5)
    pad = functools.partial(F.pad, pad=widths)
    gm = make_fx(pad, tracing_mode="fake")(x)
    assert cropping_pads_as_slices(gm) == 1
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and "pad" in str(n.target)
                and min(n.args[1]) < 0], gm.code
    assert torch.equal(gm(x), pad(x))


class TimeMix(torch.nn.Module):
    """RWKV's token mix ``x + (shift(x) - x) * mix`` before causal attention, the shift a pad that crops:
    ``"zeropad"`` (``nn.ZeroPad2d((0, 0, 1, -1))``), ``"two"`` (``F.pad`` two rows back) or ``"next"`` (the next
    position's row, cropped from the front)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.embed = torch.nn.Embedding(32, 16)
        self.mix = torch.nn.Parameter(torch.rand(16))
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 8)

    def forward(self, input_ids):
        import torch.nn.functional as F

        x = self.embed(input_ids)
        shifted = {"zeropad": lambda: torch.nn.ZeroPad2d((0, 0, 1, -1))(x), "two": lambda: F.pad(x, (0, 0, 2, -2)),
                   "next": lambda: F.pad(x, (0, 0, -1, 1))}[self.form]()
        h = x + (shifted - x) * self.mix
        q, k, v = self.qkv(h).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        out = self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
        return out.pow(2).sum(), out


def time_mix_parity(group, form: str) -> list[dict]:
    torch.manual_seed(0)
    return small_parity(group, TimeMix(form), cp_passes.CPSpec(), [16])


@pytest.mark.full
@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("form", ["zeropad", "two", "next"])
def test_a_token_mix_with_a_cropping_pad_matches_one_device(pool, parity_report, P, form):
    """The cropping pad read as a shift (a halo of the rows it moves), on the balanced layout: as on one device."""
    per_rank = pool.run(time_mix_parity, P, form=form)
    compare_small(f"time-mix-{form}-aot_eager", [r[0] for r in per_rank], lambda: TimeMix(form), 16, parity_report)
    assert ("shift_stencil", "shift") in [r[:2] for r in per_rank[0][0]["records"]]
