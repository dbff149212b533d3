import json
import math
import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """The test models are tiny: they run fastest on one thread, and many times
    slower when two threads contend for the 2 cores of a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """Under `make mutants`, a mutant's tests run fastest first, so that a killed mutant
    (most of them) costs the quickest test that catches it rather than whichever came first.
    mutmut runs them from mutants/, where its stats file holds each test's duration."""
    if "__mutmut_" not in os.environ.get("MUTANT_UNDER_TEST", ""):
        return
    stats = Path("mutmut-stats.json")
    if not stats.exists():
        return
    durations = json.loads(stats.read_text())["duration_by_test"]
    items.sort(key=lambda item: durations.get(item.nodeid, math.inf))
