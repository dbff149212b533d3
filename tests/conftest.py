import atexit
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# Nothing in the tests may come from the Hugging Face hub (every model is built from a local
# config), and the code of the remote-code folders they load goes to a cache of their own,
# not the user's (~/.cache/huggingface/modules). Set before any test imports transformers.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
_MODULES_CACHE = tempfile.mkdtemp(prefix="depthdiag-test-hf-modules-")
os.environ["HF_MODULES_CACHE"] = _MODULES_CACHE
atexit.register(shutil.rmtree, _MODULES_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """The test models are tiny: they run fastest on one thread, and many times
    slower when two threads contend for the 2 cores of a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """Under `make mutants`, a mutant's tests run so that a killed mutant (most of them) costs the
    quickest tests that catch it. mutmut names them in no particular order, and pytest sets a
    module-scoped fixture (a tiny training run) up again at every return to its file, so each
    file's tests run together: first the files without such a fixture, then those with one, each
    group by its tests' summed duration and each file's tests fastest first (mutmut runs them from
    mutants/, where its stats file holds each test's duration)."""
    if "__mutmut_" not in os.environ.get("MUTANT_UNDER_TEST", ""):
        return
    stats = Path("mutmut-stats.json")
    if not stats.exists():
        return
    durations = json.loads(stats.read_text())["duration_by_test"]

    def duration(item):
        return durations.get(item.nodeid, math.inf)

    def shares_a_fixture(item):
        definitions = item._fixtureinfo.name2fixturedefs.values()
        return any(d.scope in ("module", "class", "package") for defs in definitions for d in defs)

    by_file = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)

    def file_order(file_items):
        return any(map(shares_a_fixture, file_items)), sum(map(duration, file_items))

    items[:] = [
        item for file_items in sorted(by_file.values(), key=file_order) for item in sorted(file_items, key=duration)
    ]
