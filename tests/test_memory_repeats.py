"""The memory estimate's single-device partition with a stack of identical blocks cut to three calls
(:mod:`cp_passes.report.repeats`), on a fake process group.

The cut changes nothing the estimate reports: what one device saves for the backward is the uncut partition's,
byte for byte, wherever the blocks form a chain (each reading only its predecessor's results, parameters of its
own, and values every block is given) and wherever they do not (a block's result read outside the chain, an op
between blocks, blocks sharing a weight, a block carrying two values, one block fed differently); only a chain is
cut.
"""

import re

import pytest
import torch
from torch import nn

import cp_passes.tools.dryrun
from cp_passes.report.memory import saved_activation_bytes
from cp_passes.tools.dryrun import dry_run
from cp_passes.tools.models import ToyLlama, ToyLlamaConfig
from shared import MaskedBlock

INPUTS = {"input_ids": ((2, 16), torch.int64)}


class Pair(nn.Module):
    """A block carrying two values: attention over the first, the second handed on scaled. (Handed the same
    tensor for both, the region fails in torch 2.13 itself: ``torch.compile`` of it, without cp_passes, breaks
    in SDPA with a [2, 2, 16, 8] mask.)"""

    def __init__(self):
        super().__init__()
        self.inner, self.scale = MaskedBlock(), nn.Parameter(torch.ones(8))

    def forward(self, x, y, pos):
        return self.inner(x, pos) + y, x * self.scale


class Chain(nn.Module):
    """Six blocks, in one of several arrangements (``kind``)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList((Pair() if kind == "pair" else MaskedBlock()) for _ in range(6))
        if kind == "shared":
            for block in self.blocks[1:]:
                block.qkv = self.blocks[0].qkv

    def forward(self, input_ids):
        x = self.embed(input_ids)
        pos, y, taps = torch.arange(input_ids.shape[1]), x * 2, 0  # not x itself: see Pair
        for i, block in enumerate(self.blocks):
            if self.kind == "pair":
                x, y = block(x, y, pos)
            elif self.kind == "tap":  # every block's result also read at the end
                x = block(x, pos)
                taps = taps + x.sum()
            elif self.kind == "between":  # an op between blocks
                x = block(x, pos) * 0.5
            elif self.kind == "fed_apart":  # the fourth block also given the embedding
                x = block(x + (self.embed(input_ids) if i == 3 else 0), pos)
            else:
                x = block(x, pos)
        return x.pow(2).sum() + y.sum() + taps


def _single(build, group):
    return dry_run(build, INPUTS, mesh=group, memory=True, regions=True).memory.single_saved


@pytest.mark.parametrize("kind,cut", [
    pytest.param("chain", 3, marks=pytest.mark.full),  # a chain cut: test_a_cut_llama_saves_what_the_flat_graph_saves
    ("tap", 0),
    pytest.param("between", 0, marks=pytest.mark.full), pytest.param("shared", 3, marks=pytest.mark.full),
    pytest.param("pair", 3, marks=pytest.mark.full), pytest.param("fed_apart", 0, marks=pytest.mark.full)])
def test_cutting_a_stack_of_blocks_saves_what_the_whole_stack_saves(fake_group, monkeypatch, kind, cut):
    """``cut`` blocks are taken out (six in a chain: the third to the fifth; ``fed_apart`` splits it into runs of
    three and two, too short to cut), and one device saves the same bytes as without the cut."""
    saved = _single(lambda: Chain(kind), fake_group)
    with monkeypatch.context() as patched:
        patched.setattr(cp_passes.tools.dryrun, "elide_repeats", lambda gm: [])
        whole = _single(lambda: Chain(kind), fake_group)
    taken = sorted({found.group(1) for s in saved if (found := re.search(r" \(as in (.*)\)$", s.name))})
    assert taken == [f"blocks.{i}" for i in range(2, 2 + cut)], taken
    assert saved_activation_bytes(saved) == saved_activation_bytes(whole) > 0
    assert len(saved) == len(whole)


@pytest.mark.full  # the cut itself: test_cutting_a_stack_of_blocks_saves_what_the_whole_stack_saves
def test_a_cut_llama_saves_what_the_flat_graph_saves(fake_group):
    """ToyLlama's four blocks, regions and the stack cut, against the model exported whole: the rank's saved
    activations and one device's are the same bytes (a block hands back its weights, its input and the positions'
    cos and sin for its backward: the caller's tensors, counted as the flat graph counts them)."""
    inputs = {name: ((2, 16), torch.int64) for name in ("input_ids", "labels")}
    flat, regions = (dry_run(lambda: ToyLlama(ToyLlamaConfig(n_layers=4)), inputs, mesh=fake_group, memory=True,
                             regions=r).memory for r in (None, True))
    assert any(" (as in layers.2)" in s.name for s in regions.single_saved)
    assert regions.saved_bytes == flat.saved_bytes > 0
    assert saved_activation_bytes(regions.single_saved) == saved_activation_bytes(flat.single_saved) > 0
