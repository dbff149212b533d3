"""diag.DepthMonitor in a loop of its own: a resumed run writes the file of an uninterrupted one,
only rank 0 checks, a stranger's file at its path is never replaced, and window_batches is a pure
function of (seed, step, i)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import xarray as xr
from huginn_convention import HuginnConvention

import diag
from analysis.monitor import open_monitor
from common.errors import InputError
from diag.arithmetic.families import HUGINN
from diag.in_training.monitor import window_batches

UPDATES, EVERY = 12, 4
TOKENS = torch.randint(0, 48, (4000,), generator=torch.Generator().manual_seed(0))
DATA = window_batches(TOKENS, batch_size=4, seq_len=10, seed=0)


def monitor(path, **kwargs) -> diag.DepthMonitor:
    return diag.DepthMonitor(
        path,
        batches=window_batches(TOKENS, batch_size=4, seq_len=10, seed=1),
        eval_tokens=window_batches(TOKENS, batch_size=6, seq_len=10, seed=2)(0, 0),
        every=EVERY,
        batches_per_check=2,
        update_depths=(2, 4),
        serving_depths=(1, 2, 4),
        family=HUGINN,
        grad_clip=1.0,
        schedule="fixed-first:k0=2,switch=0.5,finish=uniform:1-4",
        updates=UPDATES,
        **kwargs,
    )


def start():
    torch.manual_seed(0)
    model = HuginnConvention(vocab=48)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def train(model, optimizer, steps, watching):
    for step in steps:
        batch = DATA(step, 0)
        logits = model(batch[:, :-1], **HUGINN.gradient_call(2 + step % 3)).logits
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        watching.after_update(step + 1, model, optimizer)


def test_a_resumed_run_writes_the_file_of_an_uninterrupted_one(tmp_path):
    model, optimizer = start()
    train(model, optimizer, range(UPDATES), monitor(tmp_path / "whole.h5"))

    model, optimizer = start()
    interrupted = monitor(tmp_path / "resumed.h5")
    train(model, optimizer, range(5), interrupted)  # checked at 4; a checkpoint at 5 ...
    saved, rng = copy.deepcopy((model, optimizer)), torch.get_rng_state()  # the model draws its initial state
    train(model, optimizer, range(5, 9), interrupted)  # ... checked at 6 (the switch) and 8, then killed
    model, optimizer = saved
    torch.set_rng_state(rng)
    train(model, optimizer, range(5, UPDATES), monitor(tmp_path / "resumed.h5", start_step=5))

    whole, resumed = open_monitor(tmp_path / "whole.h5"), open_monitor(tmp_path / "resumed.h5")
    assert whole.step.values.tolist() == [4, 6, 8, 12]  # every 4, and the switch at 6
    xr.testing.assert_identical(whole.drop_attrs(), resumed.drop_attrs())
    volatile = {"created", "git_dirty", "git_commit"}
    assert {k: v for k, v in whole.attrs.items() if k not in volatile} == {
        k: v for k, v in resumed.attrs.items() if k not in volatile
    }


def test_a_resume_with_other_settings_is_refused(tmp_path):
    model, optimizer = start()
    train(model, optimizer, range(5), monitor(tmp_path / "m.h5"))
    with pytest.raises(InputError, match="written by a run of another config"):
        monitor(tmp_path / "m.h5", check_steps=(5,), start_step=5)


def test_only_rank_zero_checks(tmp_path, monkeypatch):
    model, optimizer = start()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    train(model, optimizer, range(5), monitor(tmp_path / "m.h5"))
    assert not (tmp_path / "m.h5").exists()


def test_a_file_that_is_not_a_monitor_file_is_never_replaced(tmp_path):
    stranger = tmp_path / "m.h5"
    stranger.write_text("mine")
    model, optimizer = start()
    with pytest.raises(InputError, match="exists and is not a monitor file"):
        train(model, optimizer, range(5), monitor(stranger))
    assert stranger.read_text() == "mine"


def test_window_batches_are_a_pure_function_of_seed_step_and_index():
    again = window_batches(TOKENS.numpy(), batch_size=4, seq_len=10, seed=0)
    assert torch.equal(DATA(3, 1), again(3, 1)) and DATA(3, 1).shape == (4, 11)
    assert not torch.equal(DATA(3, 1), DATA(3, 0)) and not torch.equal(DATA(3, 1), DATA(4, 1))
    rows = DATA(7, 0)
    starts = [int((TOKENS.unfold(0, 11, 1) == row).all(1).nonzero()[0]) for row in rows]
    assert all(torch.equal(TOKENS[s : s + 11], row) for s, row in zip(starts, rows))  # windows of the array
    with pytest.raises(InputError, match="fewer than seq_len"):
        window_batches(TOKENS[:5], batch_size=1, seq_len=10)
