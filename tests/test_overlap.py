"""Collectives that overlap compute (structure, on a fake process group: rank 3 of 8).

Causal attention's key gather is started, waited for and put in order as separate nodes; the rank's queries
attend to its own keys while the other ranks' travel; :mod:`cp_passes.compiler.schedule` orders AOTAutograd's
graphs so that each start comes as early as its inputs allow and each wait after the compute that does not need
it, one collective in flight. Loss and gradients are the parity runs' (tests/test_parity.py's ToyLlama, both
layouts, both backends; tests/test_regions.py), whose causal attention takes this path.
"""

import pytest
import torch
import torch.fx

import cp_passes
from cp_passes.compiler.schedule import schedule_for_overlap
from cp_passes.graph.calls import WAIT, is_start
from cp_passes.tools.dryrun import dry_run
from cp_passes.tools.models import ToyLlama, ToyLlamaConfig

INPUTS = {name: ((1, 64), torch.int64) for name in ("input_ids", "labels")}


def _graphs(group, layout: str):
    run = dry_run(lambda: ToyLlama(ToyLlamaConfig(n_layers=3)), INPUTS, cp_passes.CPSpec(layout=layout),
                  mesh=group, memory=True)
    return run, (run.forward, run.backward)  # the partition the dry run measured


@pytest.mark.full  # the prefix exchange's overlap: the other tests of this module
@pytest.mark.parametrize("layout", ["balanced", "contiguous"])
def test_every_key_gather_waits_after_compute_that_does_not_need_it(fake_group, layout):
    run, (forward, backward) = _graphs(fake_group, layout)
    assert run.overlap.total > 0 and run.overlap.overlapped == run.overlap.total, run.overlap
    attentions = 0
    for graph in (forward.graph, backward.graph):
        nodes = list(graph.nodes)
        position = {n: i for i, n in enumerate(nodes)}
        in_flight = None
        for node in nodes:
            if is_start(node):
                assert in_flight is None, f"{node.name} starts while {in_flight.name} is in flight"
                in_flight = node
            elif node.target is WAIT:
                assert node.args[0] is in_flight
                in_flight = None
        assert in_flight is None
        for rest in graph.find_nodes(op="call_function", target=torch.ops.cp_passes.block_attention_rest.default):
            own = rest.args[3].args[0]  # the rank's own keys' attention, whose output the rest merges into
            assert own.target is torch.ops.cp_passes.block_attention.default
            wait = _waited(rest.args[1])
            assert position[wait.args[0]] < position[own] < position[wait], (wait.args[0], own, wait)
            attentions += 1
    assert attentions == 3  # one a layer, in the forward (the backward differentiates the merged call)


def _waited(node: torch.fx.Node) -> torch.fx.Node:
    """The wait the keys ``node`` came through."""
    todo = [node]
    while todo:
        node = todo.pop()
        if node.target is WAIT:
            return node
        todo.extend(node.all_input_nodes)
    raise AssertionError("no wait before the keys")


def test_side_effects_and_the_collectives_order_are_kept():
    """A mutation is a barrier no node crosses; the collectives keep their order; waits come after the compute
    that does not need them."""
    graph = torch.fx.Graph()
    x, buf = graph.placeholder("x"), graph.placeholder("buf")
    a2a = torch.ops._c10d_functional.all_to_all_single.default
    first = graph.call_function(a2a, (x, [2], [2], "0"))
    wait = graph.call_function(WAIT, (first,))
    y = graph.call_function(torch.ops.aten.sin.default, (x,))
    copied = graph.call_function(torch.ops.aten.copy_.default, (buf, y))
    z = graph.call_function(torch.ops.aten.cos.default, (x,))
    second = graph.call_function(a2a, (z, [2], [2], "0"))
    wait2 = graph.call_function(WAIT, (second,))
    out = graph.call_function(torch.ops.aten.add.Tensor, (wait, wait2))
    graph.output((out, copied))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert schedule_for_overlap(gm)
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    # sin runs before the first wait; copy_ stays after it and before cos; the second start after cos
    assert order == [first, y, wait, copied, z, second, wait2, out], [n.name for n in order]
