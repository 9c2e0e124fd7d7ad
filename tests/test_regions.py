"""Repeated layers planned once (``cp_compile(regions=True)``: each repeated block a nested compile region).

On a fake process group: a model's regions give the rewrite table the flat graph gives, each distinct block
planned once; a region its calls cannot share (a mask built outside it, a partial sum returned, calls that
differ) is inlined at its calls, saying why. On real processes (the pool's task :func:`parity`): loss and
gradients as on one device, ToyLlama with two kinds of block and transformers' Llama.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cp_passes
from cp_passes.tools.dryrun import dry_run
from cp_passes.tools.models import ToyLlama
from shared import MIXED, MaskedBlock

def _rows(run):
    return sorted((r.rule, r.transport, r.bytes, r.lower_bound_bytes, r.module) for r in run.record.records)


def _inlined(run):
    return [label for label, _ in run.record.history if " inlined at its " in label]


def test_each_kind_of_block_is_planned_once_with_the_flat_table(fake_group):
    inputs = {name: ((2, 16), torch.int64) for name in ("input_ids", "doc_ids", "labels")}
    flat = dry_run(lambda: ToyLlama(MIXED), inputs, mesh=fake_group)
    regions = dry_run(lambda: ToyLlama(MIXED), inputs, mesh=fake_group, regions=True)
    assert _rows(regions) == _rows(flat)
    planned = {label.split(":")[0] for label, _ in regions.record.history if label.startswith("repeated_subgraph")}
    assert len(planned) == 2 and not _inlined(regions), [label for label, _ in regions.record.history]


class Stack(nn.Module):
    """Two blocks given a causal ``[S, S]`` mask built outside them from positions (``"outside"``: for each block;
    ``"outside_once"``: one for both), from positions and document ids (``"outside_documents"``) or from
    activations (``"activations"``); the positions (``"positions"``); the documents' ids for the first block
    and a copy of them for the next (``"differ"``); the ids, each block returning a sum (``"sum"``)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList(MaskedBlock(returns_sum=kind == "sum") for _ in range(2))

    def forward(self, input_ids, doc_ids):
        x, total = self.embed(input_ids), 0
        pos = torch.arange(input_ids.shape[1])
        causal = pos[:, None] >= pos[None, :]
        for i, block in enumerate(self.blocks):
            if self.kind == "outside_once":
                x = block(x, causal)
            elif self.kind == "positions":
                x = block(x, pos)
            elif self.kind == "outside":
                x = block(x, pos[:, None] >= pos[None, :])
            elif self.kind == "outside_documents":
                x = block(x, ((pos[:, None] >= pos[None, :]) & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None])
            elif self.kind == "activations":
                score = self.embed(input_ids).sum(-1)
                x = block(x, (score[:, :, None] >= score[:, None, :])[:, None] | (pos[:, None] == pos[None, :]))
            elif self.kind == "differ":
                x = block(x, doc_ids if i == 0 else doc_ids + 0)
            else:
                x, part = block(x, doc_ids)
                total = total + part
        return x.pow(2).sum() + total


@pytest.mark.parametrize("kind", ["outside", "outside_once", "outside_documents", "positions"])
def test_a_mask_built_outside_from_positions_is_computed_inside_the_region(fake_group, kind):
    """The blocks are handed an ``[S, S]`` causal mask built from ``arange`` (and the documents' ids), or the
    positions themselves: it is moved into the region (DeepSeek V4 builds its masks and positions so), which is
    planned once, with the flat graph's table."""
    inputs = {"input_ids": ((2, 16), torch.int64), "doc_ids": ((2, 16), torch.int64)}
    flat = dry_run(lambda: Stack(kind), inputs, mesh=fake_group)
    regions = dry_run(lambda: Stack(kind), inputs, mesh=fake_group, regions=True)
    assert not _inlined(regions) and _rows(regions) == _rows(flat)
    assert any(label.endswith("are computed inside it") for label, _ in regions.record.history)


@pytest.mark.parametrize("kind,why", [("activations", "[seq, seq] block"), ("differ", "its calls differ"),
                                      ("sum", "returns a per-rank partial sum")])
def test_a_region_its_calls_cannot_share_is_inlined(fake_group, kind, why):
    inputs = {"input_ids": ((2, 16), torch.int64), "doc_ids": ((2, 16), torch.int64)}
    flat = dry_run(lambda: Stack(kind), inputs, mesh=fake_group)
    regions = dry_run(lambda: Stack(kind), inputs, mesh=fake_group, regions=True)
    (inlined,) = _inlined(regions)
    assert why in inlined, inlined
    assert _rows(regions) == _rows(flat)


class IndexerBlock(nn.Module):
    """A GLM5-Next decoder layer's contract: it returns ``(hidden, top-k indices)``, the indices None in layers
    without an indexer, and takes the previous layer's indices (None, or a tensor it reuses)."""

    def __init__(self, indexer: bool):
        super().__init__()
        self.qkv, self.indexer = nn.Linear(8, 24), indexer

    def forward(self, x, previous=None):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        out = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        if self.indexer:
            return out, out.argmax(-1)
        return (out if previous is None else out * 2), None


class IndexerStack(nn.Module):
    def __init__(self, kinds=(False, False, True, False, False)):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList(IndexerBlock(kind) for kind in kinds)

    def forward(self, input_ids):
        x, indices = self.embed(input_ids), None
        for block in self.blocks:
            x, indices = block(x, indices)
        assert indices is None
        return x.pow(2).sum()


def test_a_block_returning_none_is_traced_once_per_kind(fake_group):
    """dynamo reuses a region's trace only where it returns tensors; a None in a block's returned tuple leaves the
    region as a marker and is put back outside, so each call after a kind's first is reused, and the model still
    sees None."""
    from unittest import mock

    from torch._dynamo.variables import invoke_subgraph as dynamo_regions

    eligible = []

    def spy(*args, **kwargs):
        eligible.append(reuse(*args, **kwargs))
        return eligible[-1]

    reuse = dynamo_regions.is_reuse_eligible
    inputs = {"input_ids": ((2, 16), torch.int64)}
    with mock.patch.object(dynamo_regions, "is_reuse_eligible", spy):
        regions = dry_run(IndexerStack, inputs, mesh=fake_group, regions=True)
    # three traces, each reusable: blocks 0 (given no indices; blocks 1 and 4 reuse it), 2 (an indexer) and 3
    # (given indices). Before the marker: five traces, none reusable.
    assert eligible == [True, True, True], eligible
    flat = dry_run(IndexerStack, inputs, mesh=fake_group)
    assert _rows(regions) == _rows(flat) and not _inlined(regions)
    torch.manual_seed(0)
    model = IndexerStack()
    ids = torch.randint(0, 32, (2, 16))
    expected = model(ids)
    cp_passes.compiler.regions.mark_regions(model, [IndexerBlock])
    assert torch.equal(model(ids), expected)  # eager, marked: the Nones are back


class ScaledBlock(nn.Module):
    """A block whose forward reads its own index as a Python number: dynamo guards on it, so each layer is a trace
    of its own (Zamba2's layers read theirs)."""

    def __init__(self, index: int):
        super().__init__()
        self.index, self.proj = index, nn.Linear(8, 8)

    def forward(self, x):
        return x + self.proj(x) * (self.index + 1)


class ScaledStack(nn.Module):
    def __init__(self, layers: int = 12):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList(ScaledBlock(i) for i in range(layers))

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return x.pow(2).sum()


def test_more_layer_traces_than_torch_keeps_by_default(fake_group):
    """Twelve layers, each a trace of its own, past the 8 a nested compile region keeps by default (where dynamo
    raised 'exceeded maximum reuse entries', as on Zamba2's default config): the model plans as the flat one."""
    inputs = {"input_ids": ((2, 16), torch.int64)}
    regions = dry_run(ScaledStack, inputs, mesh=fake_group, regions=True)
    assert _rows(regions) == _rows(dry_run(ScaledStack, inputs, mesh=fake_group))


class WritingBlock(nn.Module):
    """Causal attention over two heads that writes a buffer in place at each call: ``"counter"`` counts its calls
    (``add_``), ``"setitem"`` counts into an element, ``"weight_norm"`` keeps its weight's norm (``copy_``)."""

    def __init__(self, writes: str, d: int = 16):
        super().__init__()
        self.writes = writes
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x):
        if self.writes == "counter":
            self.calls.add_(1)
        elif self.writes == "setitem":
            self.seen[0] = self.seen[0] + 1
        else:
            self.calls.copy_(self.qkv.weight.detach().norm())
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        return x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


class WritingStack(nn.Module):
    def __init__(self, writes: str):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(WritingBlock(writes) for _ in range(2))

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return x.pow(2).sum()


@pytest.mark.parametrize("writes", ["counter", "setitem", "weight_norm"])
def test_a_block_that_writes_a_buffer_is_inlined_naming_it(fake_group, writes):
    """torch's invoke_subgraph cannot train through a block that writes its operands in place (a step counter,
    a kept statistic); cp_passes chose the region, so it inlines it, naming the buffer, and plans the flat graph."""
    inputs = {"input_ids": ((2, 16), torch.int64)}
    flat = dry_run(lambda: WritingStack(writes), inputs, mesh=fake_group)
    regions = dry_run(lambda: WritingStack(writes), inputs, mesh=fake_group, regions=True)
    (inlined,) = _inlined(regions)
    buffer = "seen" if writes == "setitem" else "calls"
    assert f"_modules['blocks']._modules['0']._buffers['{buffer}'] in place" in inlined, inlined
    assert _rows(regions) == _rows(flat)


def writing_parity(group) -> dict:
    """Per kind of write: loss and gradient differences from one device (relative) after two steps, and the
    buffers' largest difference."""
    found = {}
    ids = torch.randint(0, 32, (2, 8 * group.size()), generator=torch.Generator().manual_seed(3))
    for writes in ("counter", "weight_norm"):
        torch._dynamo.reset()
        model, reference = [(torch.manual_seed(0), WritingStack(writes))[1] for _ in range(2)]
        compiled = cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False, regions=True)
        (local, _) = cp_passes.shard_batch({"input_ids": ids}, group)
        for _ in range(2):
            reference_loss = reference(ids)
            reference_loss.backward()
            loss = compiled(**local)
            loss.backward()
        inlined = [label for label, _ in compiled.compile_records[-1].history if " inlined at its " in label]
        buffers = max((b - r).abs().max().item() for b, r in zip(model.buffers(), reference.buffers()))
        found[writes] = _relative(group, loss, model, reference_loss.detach(), reference) + (buffers, inlined)
    return found


def test_blocks_that_write_buffers_match_one_device(pool):
    """Two steps of blocks that count their calls or keep their weight's norm in a buffer, as regions (inlined):
    loss, gradients and the buffers as on one device."""
    for found in pool.run(writing_parity, 2):
        for writes, (loss, grads, buffers, inlined) in found.items():
            assert loss < 1e-5 and grads < 1e-5 and buffers == 0, (writes, loss, grads, buffers)
            assert len(inlined) == 1, inlined


def _toy_batch(seq_len: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, seq_len), generator=g)
    doc = (torch.arange(seq_len) >= seq_len // 3).long() + (torch.arange(seq_len) >= seq_len - 3).long()
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    return {"input_ids": ids, "doc_ids": doc.expand(2, -1).clone(), "labels": labels}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))


def _relative(group, compiled_loss, model, reference_loss, reference) -> tuple[float, float]:
    import torch.distributed as dist

    total = compiled_loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = 0.0
    for p, r in zip(model.parameters(), reference.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grads = max(grads, ((g - r.grad).abs().max() / r.grad.abs().max()).item())
    return (abs(total - reference_loss) / abs(reference_loss)).item(), grads


def parity(group, backend: str, seq_len: int, models: tuple[str, ...] = ("toy", "llama")) -> dict:
    """Per model: (loss, gradient) differences from one device, relative, and the region names its graph planned."""
    found = {}
    batch = _toy_batch(seq_len)
    builds = {"toy": lambda: (torch.manual_seed(0), ToyLlama(MIXED))[1], "llama": _llama,
              "outside": lambda: (torch.manual_seed(0), Stack("outside"))[1]}
    for name, build in ((name, builds[name]) for name in models):
        torch._dynamo.reset()
        model, reference = build(), build()
        inputs = {"toy": batch, "outside": {"input_ids": batch["input_ids"] % 32, "doc_ids": batch["doc_ids"]}}.get(
            name, {"input_ids": batch["input_ids"], "labels": batch["input_ids"]})
        out = reference(**inputs)
        reference_loss = out[0] if name == "toy" else out if name == "outside" else out.loss
        reference_loss.backward()
        compiled = cp_passes.cp_compile(model, mesh=group, backend=backend, verbose=False, regions=True)
        local, _ = cp_passes.shard_batch(inputs, group)
        out = compiled(**local)
        loss = out[0] if name == "toy" else out if name == "outside" else out.loss
        loss.backward()
        regions = sorted({label.split(":")[0] for label, _ in compiled.compile_records[-1].history
                          if label.startswith("repeated_subgraph")})
        found[name] = _relative(group, loss, model, reference_loss.detach(), reference) + (regions,)
    return found


@pytest.mark.parametrize("P,backend,models", [
    pytest.param(2, "aot_eager", ("toy",), id="P2-aot_eager"),
    pytest.param(2, "aot_eager", ("outside",), marks=pytest.mark.full, id="P2-aot_eager-outside"),
    pytest.param(2, "aot_eager", ("llama",), marks=pytest.mark.full, id="P2-aot_eager-llama"),
    pytest.param(2, "inductor", ("toy", "llama"), marks=pytest.mark.full, id="P2-inductor"),
    pytest.param(4, "aot_eager", ("toy", "llama"), marks=pytest.mark.full, id="P4-aot_eager"),
    pytest.param(4, "inductor", ("toy", "llama"), marks=pytest.mark.full, id="P4-inductor"),
])
def test_regions_match_one_device(pool, P, backend, models):
    """ToyLlama with two kinds of block (window 5 over packed documents, a convolution in every other block; at P = 4
    a document spans three ranks and the window is longer than a rank's chunk) and transformers' Llama (3 layers,
    one kind; -m full): each kind planned once, loss and gradients as on one device; and (P = 2, -m full; by default
    the structure tests above) blocks handed a causal mask built outside them, which is computed inside the region."""
    for rank, found in enumerate(pool.run(parity, P, backend=backend, seq_len=4 * P, models=models)):
        assert sorted(found) == sorted(models)
        for name, (loss, grads, regions) in found.items():
            assert loss < 1e-5 and grads < 1e-4, (rank, name, loss, grads)
            assert len(regions) == (2 if name == "toy" else 1), (rank, name, regions)
