"""A diagnose run's data goes down once (docs/architecture.md): traced while it runs, through every
input route (snapshot file, checkpoint, snapshot folder, Hugging Face folder), the project's modules
call each other along a graph without a cycle, so no module is visited again once the run has
gone below it: input -> the one form the arithmetic takes -> units -> results store.

test_layers.py reads the imports; this file watches the calls, which also catch a module that
reaches back up through an object it was handed. A function handed down as an argument and called
back (a callback, such as the state function the scoring runs the model with) belongs to the
module that handed it down: the caller never names it, so it is not a call back up. The same rule
leaves out a call back up through getattr or functools.partial, and a generator resumed in
another module than the one that made it: the trace sees the calls the code spells out."""

import collections
import sys

import pytest
import torch
from click.testing import CliRunner
from graph_helpers import find_cycle
from helpers import write_run

import diag
from depthdiag.cli import main
from trainer.model import LoopedTransformer, ModelConfig

PACKAGES = ("common.", "trainer.", "diag.", "analysis.", "depthdiag.")
CALLED_BY_SYNTAX = "forward"
"""Called by `module(...)` (nn.Module.__call__ in torch), as dunders are by their syntax."""


def project_module(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name.startswith(PACKAGES) else None


def traced_calls(run) -> collections.Counter:
    """(caller module, callee module) -> calls, for the project's direct calls between its modules
    while `run()` runs: the callee's name is written in the caller's code (or called by syntax),
    the caller being the nearest project frame below it (torch's frames in between skipped)."""
    edges: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event != "call" or (callee := project_module(frame)) is None:
            return
        code = frame.f_code
        if code.co_name == "<module>":  # an import, not a step of the run
            return
        below = frame.f_back
        while below is not None and project_module(below) is None:
            below = below.f_back
        if below is None or (caller := project_module(below)) == callee:
            return
        named = code.co_name in below.f_code.co_names
        if named or code.co_name.startswith("__") or code.co_name == CALLED_BY_SYNTAX:
            edges[caller, callee] += 1

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(before)
    return edges


def module_cycle(edges) -> list[str] | None:
    """One cycle [a, b, ..., a] of the call graph, or None."""
    graph = collections.defaultdict(set)
    for caller, callee in edges:
        graph[caller].add(callee)
    return find_cycle(graph)


def diagnose_calls(*args) -> collections.Counter:
    def run():
        result = CliRunner().invoke(main, ["diagnose", *map(str, args), "--no-progress"], prog_name="depthdiag")
        assert result.exit_code == 0, result.output

    return traced_calls(run)


def assert_goes_down_once(edges):
    assert ("diag.driver.run", "analysis.store") in edges  # the trace saw the run through to its results
    assert any(callee.startswith("diag.arithmetic.") for _, callee in edges)
    cycle = module_cycle(edges)
    assert cycle is None, "a diagnose run's calls go back up: " + " -> ".join(cycle)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("run"))


DEPTHS = ("--update-depths", "2,3", "--serving", "1,3", "--batches", "1")


@pytest.mark.filterwarnings("ignore::diag.BiasCorrectionWarning")
@pytest.mark.parametrize("which", [2, "checkpoint"])
def test_a_snapshot_or_checkpoint_file_goes_down_once(run, which, tmp_path):
    assert_goes_down_once(diagnose_calls(run[which], *DEPTHS, "--out", tmp_path / "r.h5"))


@pytest.mark.filterwarnings("ignore::diag.BiasCorrectionWarning")
def test_a_snapshot_folder_goes_down_once(tmp_path):
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=40, max_seq_len=8, d_model=16, n_heads=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 40, (2, 8)), depth=2).sum().backward()
    optimizer.step()
    batches, eval_tokens = torch.randint(0, 40, (1, 2, 9)), torch.randint(0, 40, (2, 9))
    folder = diag.save_snapshot(tmp_path / "snap", model, optimizer, batches, eval_tokens, step=1)
    assert_goes_down_once(diagnose_calls(folder, *DEPTHS, "--out", tmp_path / "r.h5"))


def test_a_hugging_face_folder_goes_down_once(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from huginn_convention_hf import new_model, write_folder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = write_folder(tmp_path / "hf", new_model())
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):
        torch.randint(0, 48, (600,), dtype=torch.int32).numpy().astype("uint16").tofile(data / f"{split}.bin")
    tokens = ("--data", data, "--seq-len", 8, "--eval-sequences", 2, "--train-batch-size", 2)
    edges = diagnose_calls(
        "--hf", folder, "--trust-remote-code", *tokens, "--estimate-optimizer", 1, "--lr", "1e-3", *DEPTHS,
        "--out", tmp_path / "r.h5",
    )  # fmt: skip
    assert ("diag.sources.entries", "diag.sources.hf") in edges
    assert_goes_down_once(edges)


def fake_module(name: str, source: str, **names) -> dict:
    """The globals of code run as if it were the project's module `name`."""
    namespace = {"__name__": name, **names}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace


def test_the_trace_sees_a_call_back_up_and_leaves_a_callback_to_its_caller():
    upper = fake_module("diag.sources.upper", "def describe():\n    return 'up'\n")
    lower = fake_module(
        "diag.arithmetic.lower",
        "def reach_back():\n    return describe()\n\ndef call_back(handed):\n    return handed()\n",
        describe=upper["describe"],
    )
    source = "def go():\n    return reach_back()\n\ndef hand_down():\n    return call_back(describe)\n"
    handed = {name: lower[name] for name in ("reach_back", "call_back")}
    caller = fake_module("diag.sources.upper", source, describe=upper["describe"], **handed)

    back_up = traced_calls(caller["go"])
    down, up = ("diag.sources.upper", "diag.arithmetic.lower"), ("diag.arithmetic.lower", "diag.sources.upper")
    assert back_up == {down: 1, up: 1}
    assert module_cycle(back_up) == ["diag.arithmetic.lower", "diag.sources.upper", "diag.arithmetic.lower"]
    assert traced_calls(caller["hand_down"]) == {down: 1}
    assert module_cycle({("a", "b"): 1, ("b", "c"): 1, ("c", "a"): 1}) == ["a", "b", "c", "a"]
    assert module_cycle({("a", "b"): 1, ("a", "c"): 1, ("b", "c"): 1}) is None
