import pytest

from workers import WorkerPool, raise_recompile_limits

raise_recompile_limits()


@pytest.fixture(scope="session")
def pool():
    workers = WorkerPool(world=4)
    yield workers
    workers.close()


@pytest.fixture(scope="module")
def fake_group():
    """Rank 3 of a fake 8-rank process group (structure tests: collectives return placeholders). A process
    holds one default group: every fake-group test module shares this one."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    return dist.group.WORLD


@pytest.fixture(scope="module")
def group(fake_group):
    """``fake_group`` under the short name the structure tests take."""
    return fake_group


_PARITY: list[tuple] = []


@pytest.fixture
def parity_report():
    return _PARITY


def pytest_terminal_summary(terminalreporter):
    if not _PARITY:
        return
    from tabulate import tabulate

    terminalreporter.write_sep("=", "parity against one device (fp32)")
    rows = [(name, p, s, f"{o:.2e}", f"{lo:.2e}", f"{g:.2e}") for name, p, s, o, lo, g in _PARITY]
    terminalreporter.write_line(tabulate(rows, headers=("model", "P", "seq", "max |out diff|", "loss rel",
                                                        "max grad rel")))
