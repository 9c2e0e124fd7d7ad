"""No rank is left waiting: when one rank fails or diverges, every rank raises, before any graph collective.

Real gloo processes; a hang fails the test after HANG_S seconds (the pool is then replaced)."""

import pytest

HANG_S = 240


@pytest.mark.parametrize("change,differs", [
    ("length", "rank 1 has input_ids: (2, 16) torch.int64 (sharded), rank 0 has input_ids: (2, 8) torch.int64"),
    ("rows", "rank 1 has input_ids: (1, 8) torch.int64 (sharded), rank 0 has input_ids: (2, 8) torch.int64"),
    ("dtype", "rank 1 has position_ids: (2, 8) torch.int32 (sharded), rank 0 has position_ids: (2, 8) torch.int64"),
])
def test_inputs_that_differ_across_ranks_fail_on_every_rank(pool, change, differs):
    """The second call reuses rank 0's compiled graph; before, only the first call of a length was checked,
    so rank 0 entered the graph's all-gather while rank 1 waited in the check (or gloo aborted)."""
    errors = pool.run("diverging_inputs", 2, timeout=HANG_S, change=change)
    for error in errors:
        assert error.startswith("ValueError: the CP ranks were called with different inputs"), error
        assert differs in error, error


def test_a_rank_that_cannot_compile_stops_every_rank(pool):
    errors = pool.run("compile_fails_on_one_rank", 2, timeout=HANG_S)
    assert errors[1].startswith("CPCompileError: cp_passes needs the whole forward as one graph"), errors[1]
    assert errors[0].startswith("CPCompileError: rank 1 failed to compile, so no rank runs this graph"), errors[0]
    assert "graph_break" in errors[0]


def test_ranks_that_plan_different_collectives_stop_before_running(pool):
    errors = pool.run("schedules_differ", 2, timeout=HANG_S)
    for error in errors:
        assert "planned different collective schedules" in error, error
        assert "collective #1 is halo_exchange(" in error and "but sequence_all_gather(" in error, error


def test_a_mask_leaving_the_window_in_one_ranks_rows_fails_on_every_rank(pool):
    """Rank 0's rows are documents of two tokens (inside the declared window of 2); rank 1's rows are one
    document of four. Each rank checks every row of the global mask, so both stop at the same step."""
    errors = pool.run("envelope_violation", 2, timeout=HANG_S, layout=[[(2, 2), (2, 2), (4, 4)]])
    for error in errors:
        assert "allows a key outside the causal window that the spec declares" in error, error
