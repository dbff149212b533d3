"""diag.save_snapshot: a snapshot folder from any training loop, which `depthdiag diagnose FOLDER`
reads like depthdiag's own snapshot files. Diagnosed, it equals diag.compare_updates on the live
model and optimizer it was saved from, to the bit; loading it never unpickles anything; bad
folders are one line and exit 2; an existing folder is replaced only with force, and only if
save_snapshot wrote it."""

from __future__ import annotations

import copy
import json
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from huginn_convention import HuginnConvention

import diag
from analysis.store import open_results
from common.errors import InputError
from depthdiag.cli import main
from diag.arithmetic.families import HUGINN, ModelFamily
from diag.sources.snapshot_folder import DOCUMENT, OPTIMIZER_STATE
from diag.sources.snapshot_loading import load_snapshot_folder
from trainer.model import LoopedTransformer, ModelConfig
from trainer.scoring import output_logits

pytestmark = pytest.mark.filterwarnings("ignore::diag.BiasCorrectionWarning")  # a few steps: young, on purpose

VOCAB, SEQ, ROWS = 48, 8, 4
UPDATE_DEPTHS, SERVING = (2, 10), (1, 4, 10)
"""10 > HUGINN's backprop depth 8: the gradient at depth 10 is truncated, as the family trains."""
VARIABLES = ("nll", "benefit", "update_rms", "rms_scale", "update_cosine", "train_loss")


def build_huginn(vocab: int, d: int) -> HuginnConvention:
    """The model factory the Huginn snapshot names (this module is importable as the tests run)."""
    return HuginnConvention(vocab, d)


class Lion(torch.optim.SGD):
    """An optimizer of the user's own (here only a renamed SGD): a folder cannot rebuild it without its code."""


def tokens(shape, seed):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def two_groups(model):
    """Matrices with weight decay, the rest without, as training loops group them."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def train(model, optimizer, scheduler, steps, call, first=0):
    """`steps` updates of an ordinary training loop: forward, loss, backward, clip, step, schedule."""
    for step in range(first, first + steps):
        batch = tokens((ROWS, SEQ + 1), 100 + step)
        logits = output_logits(model(batch[:, :-1], **call(step)))
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], prog_name="depthdiag")
    return result.exit_code, result.stdout, result.stderr


def diagnose(*args):
    depths = ("--update-depths", ",".join(map(str, UPDATE_DEPTHS)), "--serving", ",".join(map(str, SERVING)))
    code, stdout, stderr = cli("diagnose", *args, *depths, "--no-progress")
    assert code == 0, stderr
    return stdout


def assert_units_equal(ds, index, live_model, live_optimizer, batches, eval_tokens, **call):
    """Every unit of snapshot `index` in `ds` equals compare_updates on the live model, bit for bit."""
    for b in range(ds.sizes["batch"]):
        unit = diag.compare_updates(
            live_model,
            live_optimizer,
            batches[b],
            eval_tokens,
            update_depths=UPDATE_DEPTHS,
            serving_depths=SERVING,
            **call,
        )
        for name in VARIABLES:
            np.testing.assert_array_equal(ds[name].values[index, b], unit[name].values, err_msg=f"{name} {b}")
        np.testing.assert_array_equal(ds.nll_before.values[index], unit.nll_before.values)


def assert_same_model_and_optimizer(adapted, model, optimizer):
    """The loaded model's state_dict and the rebuilt optimizer's state_dict equal the live ones, bitwise."""
    live, loaded = model.state_dict(), adapted.model.state_dict()
    assert live.keys() == loaded.keys()
    for key in live:
        assert live[key].dtype == loaded[key].dtype and torch.equal(live[key], loaded[key]), key
    live, loaded = optimizer.state_dict(), adapted.optimizer.state_dict()
    assert type(adapted.optimizer) is type(optimizer)
    assert live["param_groups"] == loaded["param_groups"]
    assert live["state"].keys() == loaded["state"].keys()
    for index, state in live["state"].items():
        assert state.keys() == loaded["state"][index].keys()
        for key, value in state.items():
            other = loaded["state"][index][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (index, key)


@pytest.fixture(scope="module")
def huginn(tmp_path_factory):
    """A plain nn.Module of the Huginn convention, trained three AdamW steps in two param groups
    under a per-group LR schedule, saved with a factory that builds it again."""
    torch.manual_seed(0)
    model = HuginnConvention(VOCAB, 24)
    optimizer = torch.optim.AdamW(two_groups(model), lr=3e-3, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 1 / (1 + s), lambda s: 0.5 ** (s + 1)])
    train(model, optimizer, scheduler, 3, lambda step: {"num_steps": (1, 1 + step % 3)})
    folder = tmp_path_factory.mktemp("huginn") / "huginn-step3"
    batches, eval_tokens = tokens((2, ROWS, SEQ + 1), 1), tokens((5, SEQ + 1), 2)
    returned = diag.save_snapshot(
        folder,
        model,
        optimizer,
        batches,
        eval_tokens,
        step=3,
        family=HUGINN,
        grad_clip=0.5,
        model_factory=f"{__name__}:build_huginn",
        factory_kwargs={"vocab": VOCAB, "d": 24},
        metadata={"run": "test"},
    )
    assert returned == folder
    return SimpleNamespace(folder=folder, model=model, optimizer=optimizer, batches=batches, eval_tokens=eval_tokens)


def test_a_plain_modules_snapshot_diagnoses_as_compare_updates_on_the_live_model(huginn, tmp_path):
    out = tmp_path / "r.h5"
    assert diagnose(huginn.folder, "--out", out) == f"wrote {out}\n"
    ds = open_results(out)
    assert list(ds.snapshot.values) == ["huginn-step3"] and ds.sizes["batch"] == 2
    assert ds.step.values.tolist() == [3] and ds.uniform_updates.values.tolist() == [0]
    # The learning rate of the next update, as the scheduler left the first param group.
    assert ds.lr.values.tolist() == [huginn.optimizer.param_groups[0]["lr"]] == [3e-3 / 4]
    assert ds.attrs["model_family"] == "huginn" and ds.attrs["grad_clip"] == 0.5
    assert ds.attrs["optimizer_state"] == OPTIMIZER_STATE and ds.attrs["optimizer"] == "AdamW"
    assert json.loads(ds.attrs["batch_source"]) == {"huginn-step3": "snapshot"}
    config = json.loads(ds.attrs["config"])
    assert config["model"]["factory"] == f"{__name__}:build_huginn" and config["metadata"] == {"run": "test"}
    assert_units_equal(
        ds, 0, huginn.model, huginn.optimizer, huginn.batches, huginn.eval_tokens, family=HUGINN, grad_clip=0.5
    )
    assert np.abs(ds.benefit.values).max() > 0
    assert_same_model_and_optimizer(load_snapshot_folder(huginn.folder), huginn.model, huginn.optimizer)
    code, summary, err = cli("summarize", out)
    assert code == 0 and "huginn-step3" in summary, err


def test_family_calls_a_folders_model_in_place_of_the_family_it_carries(huginn, tmp_path, monkeypatch):
    (tmp_path / "folder_families.py").write_text(
        "from diag.arithmetic.families import ModelFamily\n"
        "FULL = ModelFamily('huginn-full', depth_kwarg='num_steps', pair_depth=True)\n"
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.h5"
    diagnose(huginn.folder, "--family", "folder_families:FULL", "--out", out)
    ds = open_results(out)
    assert ds.attrs["model_family"] == "huginn-full" and ds.attrs["backprop"] == "full backprop"
    full = ModelFamily("huginn-full", depth_kwarg="num_steps", pair_depth=True)
    assert_units_equal(
        ds, 0, huginn.model, huginn.optimizer, huginn.batches, huginn.eval_tokens, family=full, grad_clip=0.5
    )
    # The family is part of the input: the same one resumes the finished run, the folder's own is another run.
    depths = ("--update-depths", "2,10", "--serving", "1,4,10", "--no-progress", "--resume")
    assert cli("diagnose", huginn.folder, "--family", "folder_families:FULL", "--out", out, *depths)[0] == 0
    code, _, err = cli("diagnose", huginn.folder, "--out", out, *depths)
    assert code == 2 and "already exists" in err, err


def test_a_folder_stores_a_familys_logits_from_and_names_a_function_only_by_module(huginn, tmp_path):
    inputs = (huginn.model, huginn.optimizer, huginn.batches, huginn.eval_tokens)
    factory = {"model_factory": f"{__name__}:build_huginn", "factory_kwargs": {"vocab": VOCAB, "d": 24}}
    by_key = ModelFamily("by-key", depth_kwarg="num_steps", pair_depth=True, backprop_depth=8, logits_from="logits")
    diag.save_snapshot(tmp_path / "a", *inputs, step=3, family=by_key, **factory)
    assert load_snapshot_folder(tmp_path / "a").family == by_key
    by_function = ModelFamily("by-function", depth_kwarg="num_steps", pair_depth=True, logits_from=output_logits)
    with pytest.raises(InputError, match=r"is a family whose logits_from is a function, which a snapshot folder can"):
        diag.save_snapshot(tmp_path / "b", *inputs, step=3, family=by_function, **factory)


def test_family_is_refused_for_snapshot_files(tmp_path):
    (tmp_path / "x.pt").write_bytes(b"")
    code, _, err = cli("diagnose", tmp_path / "x.pt", "--family", "huginn", "--out", tmp_path / "r.h5")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--family huginn: only with --hf DIR, --adapter or snapshot folders; snapshot files hold" in err, err


def test_a_looped_transformer_with_tied_weights_and_sgd_round_trips_and_several_folders_diagnose_together(tmp_path):
    config = ModelConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=16, n_heads=2, n_core=1, tie_embeddings=True)
    torch.manual_seed(1)
    model = LoopedTransformer(config)
    assert model.head.weight is model.embed.weight  # one parameter, two names in the state_dict
    optimizer = torch.optim.SGD(two_groups(model), lr=0.05, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    batches, eval_tokens = tokens((1, ROWS, SEQ + 1), 3), tokens((4, SEQ + 1), 4)
    mask = torch.arange(SEQ).expand(4, SEQ) >= SEQ // 2  # the second half of each row's targets, as answers
    live = {}
    for step, first in ((2, 0), (3, 2)):
        train(model, optimizer, scheduler, step - first, lambda s: {"depth": 1 + s % 3}, first=first)
        folder = tmp_path / f"step{step}"
        diag.save_snapshot(folder, model, optimizer, batches, eval_tokens, step=step, name=f"s{step}", eval_mask=mask)
        live[step] = copy.deepcopy((model, optimizer))  # one copy: the optimizer holds the copy's parameters

    loaded = load_snapshot_folder(tmp_path / "step3")
    assert type(loaded.model) is LoopedTransformer and loaded.model.config == config
    assert loaded.model.head.weight is loaded.model.embed.weight
    assert loaded.family is None and loaded.depth_kwarg == "depth" and loaded.name == "s3"
    assert torch.equal(loaded.eval_mask, mask) and torch.equal(loaded.eval_tokens, eval_tokens)
    assert_same_model_and_optimizer(loaded, *live[3])

    out = tmp_path / "r.h5"
    diagnose(tmp_path / "step3", tmp_path / "step2", "--out", out)  # sorted by step in the results
    ds = open_results(out)
    assert list(ds.snapshot.values) == ["s2", "s3"] and ds.step.values.tolist() == [2, 3]
    assert ds.lr.values.tolist() == pytest.approx([0.05 * 0.8**2, 0.05 * 0.8**3], rel=1e-15)
    for index, step in enumerate((2, 3)):
        assert_units_equal(ds, index, *live[step], batches, eval_tokens, eval_mask=mask)


@pytest.fixture(scope="module")
def hf_snapshot(tmp_path_factory):
    """A Hugging Face remote-code model (tests/huginn_convention_hf.py's folder, loaded with its own
    code), trained two AdamW steps, saved with save_pretrained into the snapshot."""
    pytest.importorskip("transformers")
    from huginn_convention_hf import new_model, write_folder
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf")
    source = write_folder(root / "published", new_model(seed=2, vocab_size=VOCAB))
    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    train(model, optimizer, scheduler, 2, lambda step: {"num_steps": (0, 2)})
    batches, eval_tokens = tokens((1, ROWS, SEQ + 1), 5), tokens((4, SEQ + 1), 6)
    folder = diag.save_snapshot(
        root / "hf-step2", model, optimizer, batches, eval_tokens, step=2, family="huginn", grad_clip=1.0
    )
    return SimpleNamespace(folder=folder, model=model, optimizer=optimizer, batches=batches, eval_tokens=eval_tokens)


def test_a_hugging_face_models_snapshot_runs_its_code_only_when_trusted(hf_snapshot, tmp_path):
    out = tmp_path / "r.h5"
    code, _, err = cli("diagnose", hf_snapshot.folder, "--out", out)
    assert code == 2 and "--trust-remote-code" in err and len(err.strip().splitlines()) == 1, err
    diagnose(hf_snapshot.folder, "--trust-remote-code", "--out", out)
    ds = open_results(out)
    assert list(ds.snapshot.values) == ["hf-step2"] and ds.attrs["model_family"] == "huginn"
    hf = hf_snapshot
    assert_units_equal(ds, 0, hf.model, hf.optimizer, hf.batches, hf.eval_tokens, family=HUGINN, grad_clip=1.0)


@pytest.fixture
def no_unpickling(monkeypatch):
    """pickle and torch.load raise: whatever loads with them fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling while loading a snapshot folder")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    with pytest.raises(AssertionError, match="unpickling"):
        torch.load(b"")


def test_loading_a_plain_modules_snapshot_never_unpickles(huginn, no_unpickling):
    assert_same_model_and_optimizer(load_snapshot_folder(huginn.folder), huginn.model, huginn.optimizer)


def test_loading_a_hugging_face_snapshot_never_unpickles(hf_snapshot, no_unpickling):
    loaded = load_snapshot_folder(hf_snapshot.folder, trust_remote_code=True)
    assert_same_model_and_optimizer(loaded, hf_snapshot.model, hf_snapshot.optimizer)


def edited(folder: Path, target: Path, change) -> Path:
    """A copy of the snapshot folder with `change(copy)` applied."""
    shutil.copytree(folder, target)
    change(target)
    return target


def edit_document(**changes):
    def change(folder):
        document = json.loads((folder / DOCUMENT).read_text())
        for key, value in changes.items():
            section, _, field = key.partition("__")
            (document[section] if field else document)[field or section] = value
        (folder / DOCUMENT).write_text(json.dumps(document))

    return change


def changed_weight(folder):
    path = folder / "model" / "model.safetensors"
    weights = safetensors.torch.load_file(path)
    weights["head.weight"][0, 0] += 1
    safetensors.torch.save_file(weights, path)


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda f: (f / "tokens.safetensors").unlink(), "tokens.safetensors: no such file"),
        (edit_document(optimizer__class="Lion"), "optimizer class 'Lion' is not one of torch.optim's built-in"),
        (lambda f: (f / DOCUMENT).write_text('{"kind": "depthdiag-snap'), "snapshot.json: not readable JSON"),
        (edit_document(model__factory="no_such_module_xyz:build"), "cannot import 'no_such_module_xyz'"),
        (edit_document(step=-1), "'step' must be an integer >= 0"),
        (changed_weight, "the loaded model's head.weight has other values than saved"),
        (lambda f: (f / DOCUMENT).unlink(), "no snapshot.json, so not a snapshot folder"),
    ],
    ids=["missing-file", "optimizer-class", "corrupt-json", "factory", "step", "weights", "not-a-snapshot"],
)
def test_a_bad_folder_is_one_line_and_exit_2(huginn, tmp_path, change, expected):
    folder = edited(huginn.folder, tmp_path / "bad", change)
    code, _, err = cli("diagnose", folder, "--out", tmp_path / "r.h5")
    assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err
    assert err.startswith(f"depthdiag: error: {folder}")
    assert not (tmp_path / "r.h5").exists() and not (tmp_path / "r.h5.parts").exists()


def test_diagnose_refuses_mixed_inputs_and_an_output_inside_the_folder(huginn, tmp_path):
    (tmp_path / "x.pt").write_bytes(b"")
    code, _, err = cli("diagnose", huginn.folder, tmp_path / "x.pt", "--out", tmp_path / "r.h5")
    assert code == 2 and "a snapshot folder, among snapshot files" in err, err
    code, _, err = cli("diagnose", huginn.folder, "--out", huginn.folder / "r.h5")
    assert code == 2 and "inside the snapshot folder" in err, err
    code, _, err = cli("diagnose", tmp_path / "x.pt", "--trust-remote-code", "--out", tmp_path / "r.h5")
    assert code == 2 and "--trust-remote-code: only with --hf DIR or snapshot folders" in err, err


def test_save_snapshot_refuses_what_a_folder_cannot_rebuild(huginn, tmp_path):
    model, inputs = huginn.model, (huginn.batches, huginn.eval_tokens)
    factory = {"model_factory": f"{__name__}:build_huginn", "factory_kwargs": {"vocab": VOCAB, "d": 24}}
    with pytest.raises(InputError, match=r"optimizer test_any_snapshot\.Lion is not one of torch\.optim's built-in"):
        diag.save_snapshot(tmp_path / "a", model, Lion(model.parameters()), *inputs, step=0, **factory)
    with pytest.raises(InputError, match="neither a depthdiag LoopedTransformer nor a Hugging Face PreTrainedModel"):
        diag.save_snapshot(tmp_path / "b", model, huginn.optimizer, *inputs, step=0)
    with pytest.raises(InputError, match="cannot import 'no_such_module_xyz'"):
        diag.save_snapshot(  # a factory that diagnose could not import
            tmp_path / "c", model, huginn.optimizer, *inputs, step=0, model_factory="no_such_module_xyz:f"
        )
    with pytest.raises(InputError, match="not one of the model's"):
        other = torch.optim.SGD(HuginnConvention(VOCAB, 24).parameters())
        diag.save_snapshot(tmp_path / "d", model, other, *inputs, step=0, **factory)
    with pytest.raises(InputError, match="factory_kwargs do not fit its parameters"):
        diag.save_snapshot(
            tmp_path / "e", model, huginn.optimizer, *inputs, step=0, model_factory=factory["model_factory"]
        )
    assert not any(tmp_path.iterdir())  # nothing written, not even a lock


def test_force_replaces_only_a_snapshot_folder(huginn, tmp_path):
    def save(folder, step, **kwargs):
        factory = {"model_factory": f"{__name__}:build_huginn", "factory_kwargs": {"vocab": VOCAB, "d": 24}}
        args = (huginn.model, huginn.optimizer, huginn.batches, huginn.eval_tokens)
        return diag.save_snapshot(folder, *args, step=step, family=HUGINN, **factory, **kwargs)

    def step_of(folder):
        return json.loads((folder / DOCUMENT).read_text())["step"]

    folder = tmp_path / "snap"
    folder.mkdir()  # an empty folder counts as absent
    save(folder, 1)
    with pytest.raises(InputError, match="already exists; pass force=True"):
        save(folder, 2)
    save(folder, 2, force=True)
    assert step_of(folder) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["snap"]
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"holds files depthdiag does not write there \(notes.txt\)"):
        save(folder, 3, force=True)
    assert step_of(folder) == 2 and (folder / "notes.txt").read_text() == "mine"
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / DOCUMENT).write_text("{}")
    with pytest.raises(InputError, match="not a snapshot folder depthdiag wrote"):
        save(stranger, 3, force=True)
    assert (stranger / DOCUMENT).read_text() == "{}"


def test_a_loaded_hf_snapshot_is_never_saved_over_itself(hf_snapshot):
    loaded = load_snapshot_folder(hf_snapshot.folder, trust_remote_code=True)
    with pytest.raises(InputError, match="holds an input"):
        diag.save_snapshot(
            hf_snapshot.folder, loaded.model, loaded.optimizer, loaded.batches, loaded.eval_tokens, step=2, force=True
        )
    assert load_snapshot_folder(hf_snapshot.folder, trust_remote_code=True).name == "hf-step2"
