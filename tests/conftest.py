import pytest

from workers import WorkerPool, raise_recompile_limits

raise_recompile_limits()


@pytest.fixture(scope="session")
def pool():
    workers = WorkerPool(world=4)
    yield workers
    workers.close()


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
