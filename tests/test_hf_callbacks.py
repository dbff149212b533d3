"""The Trainer callbacks (diag/in_training/hf_callbacks.py): a real transformers.Trainer run of a tiny looped
model on CPU, its depth drawn per step from a fixed-first schedule, with the depth-need monitor and
a switch snapshot: monitor.h5 is written, its checks and `diagnose` on the snapshot are
compare_updates on the Trainer's own state, `recommend` reads the file, and the training ends
bit-identical to the same run without either callback."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import TokenRows
from hf_helpers import VOCAB, write_checkpoint

import diag
from analysis.monitor import open_monitor
from analysis.store import open_results
from depthdiag.cli import main
from diag.arithmetic.families import DEPTHDIAG
from diag.in_training.monitor import window_batches

transformers = pytest.importorskip("transformers")
from diag.in_training.hf_callbacks import DepthMonitorCallback, ScheduledDepthCallback, SnapshotCallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore::diag.arithmetic.engine.BiasCorrectionWarning"
)  # a few dozen steps: young
SEQ, ROWS, UPDATES, EVERY, SWITCH, CAPTURED = 12, 4, 24, 6, 12, 18
SCHEDULE = "fixed-first:k0=2,switch=0.5,finish=uniform:1-4"


class Capture(transformers.TrainerCallback):
    """Copies of the Trainer's model and optimizer after updates SWITCH and CAPTURED (and at the end)."""

    def __init__(self):
        self.states = {}

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step in (SWITCH, CAPTURED):
            self.states[state.global_step] = copy.deepcopy((model, getattr(optimizer, "optimizer", optimizer)))

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.final = {name: t.detach().clone() for name, t in model.state_dict().items()}
        inner = getattr(optimizer, "optimizer", optimizer)
        self.final_state = copy.deepcopy(inner.state_dict())
        self.rng = (torch.get_rng_state(), np.random.get_state()[1].copy())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    source = write_checkpoint(folder / "model.pt", tie_embeddings=True)
    result = CliRunner().invoke(main, ["export", str(source), "--out", str(folder / "model"), "--format", "hf"])
    assert result.exit_code == 0, result.output
    return folder / "model"


def trained(exported, out, *monitors: transformers.TrainerCallback):
    rng = np.random.default_rng(0)
    rows = torch.from_numpy(rng.integers(0, VOCAB, (200, SEQ)).astype(np.int64))
    capture = Capture()
    callbacks = [ScheduledDepthCallback(SCHEDULE, updates=UPDATES), capture, *monitors]
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=UPDATES,
        per_device_train_batch_size=ROWS,
        learning_rate=3e-3,
        warmup_steps=4,
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    transformers.Trainer(model=model, args=args, train_dataset=TokenRows(rows), callbacks=callbacks).train()
    return capture


def test_the_callbacks_write_checks_and_a_switch_snapshot_of_the_trainers_state_and_change_no_bit(exported, tmp_path):
    tokens = np.random.default_rng(1).integers(0, VOCAB, 3000)
    batches = window_batches(tokens, batch_size=ROWS, seq_len=SEQ, seed=0)
    held_out = window_batches(tokens, batch_size=6, seq_len=SEQ, seed=1)(0, 0)
    monitor = DepthMonitorCallback(
        batches=batches,
        eval_tokens=held_out,
        every=EVERY,
        update_depths=(1, 4),
        serving_depths=(1, 2, 4),
        schedule=SCHEDULE,
    )
    snapshots = SnapshotCallback(batches=batches, eval_tokens=held_out, n_batches=2, schedule=SCHEDULE)
    with_monitor = trained(exported, tmp_path / "with", monitor, snapshots)
    without = trained(exported, tmp_path / "without")

    # Training is the same to the bit: weights and optimizer state.
    assert with_monitor.final.keys() == without.final.keys()
    assert all(torch.equal(with_monitor.final[k], without.final[k]) for k in without.final)
    a, b = with_monitor.final_state["state"], without.final_state["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[p][key], b[p][key]) for p in b for key in b[p])
    assert torch.equal(with_monitor.rng[0], without.rng[0]) and (with_monitor.rng[1] == without.rng[1]).all()

    ds = open_monitor(tmp_path / "with" / "monitor.h5")
    assert ds.step.values.tolist() == [6, 12, 18, 24]  # every 6, the switch at 12 among them
    assert ds.attrs["switch_step"] == 12 and ds.attrs["schedule"] == SCHEDULE
    assert ds.attrs["model_family"] == "depthdiag"
    np.testing.assert_allclose(ds.depth_probability.sel(step=18).values, [0.25] * 4)  # uniform:1-4 after it

    # The check after update 18: compare_updates on the Trainer's own model and optimizer then.
    for i in range(2):
        expected = diag.compare_updates(
            *with_monitor.states[CAPTURED],
            batches(CAPTURED, i),
            held_out,
            update_depths=(1, 4),
            serving_depths=(1, 2, 4),
            family=DEPTHDIAG,
            grad_clip=1.0,  # the Trainer's max_grad_norm
        )
        np.testing.assert_array_equal(ds.nll.sel(step=CAPTURED, batch=i).values, expected.nll.values)

    result = CliRunner().invoke(
        main, ["recommend", str(tmp_path / "with" / "monitor.h5"), "--updates", "240", "--checks", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "recommended: fixed-first:k0=2,switch=" in result.output and "core iterations" in result.output

    # The switch snapshot: diagnose on it = compare_updates on the Trainer's state after update 12.
    assert snapshots.written == [tmp_path / "with" / f"snapshot-{SWITCH}"]
    out = tmp_path / "switch.h5"
    args = ["diagnose", str(snapshots.written[0]), "--trust-remote-code", "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(main, [*args, "--update-depths", "1,4", "--serving", "1,2,4"], prog_name="depthdiag")
    assert result.exit_code == 0, result.output
    results = open_results(out)
    for i in range(2):
        expected = diag.compare_updates(
            *with_monitor.states[SWITCH],
            batches(SWITCH, i),
            held_out,
            update_depths=(1, 4),
            serving_depths=(1, 2, 4),
            family=DEPTHDIAG,
            grad_clip=1.0,
        )
        np.testing.assert_array_equal(results.nll.isel(snapshot=0, batch=i).values, expected.nll.values)
