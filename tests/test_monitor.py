"""The in-training monitor (diag/in_training/monitor.py; its file analysis/monitor.py, its figure
analysis/figures/monitor.py): training with it equals training without it to the bit, a check is
`diag.compare_updates` on the run's state, batches and settings, a check touches no process
state, a killed and resumed run writes the same monitor file, the file's schema, and the
summarize and plot commands on it."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import xarray as xr  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from helpers import (  # noqa: E402
    DDP_CONFIG,
    Interrupt,
    assert_same_payload,
    text_corpus,
    tiny_config,
    torchrun_train,
    without_wall_time,
)
from matplotlib.collections import QuadMesh  # noqa: E402

import diag  # noqa: E402
from analysis.figures import monitor_figure, plot_monitor_heatmap, plot_monitor_trend  # noqa: E402
from analysis.monitor import MONITOR_VARIABLES, is_monitor_file, open_monitor  # noqa: E402
from analysis.stats import (  # noqa: E402
    IntervalOptions,
    monitor_benefit_map,
    monitor_depth_averaged_benefit,
    monitor_summary_table,
    t_interval,
)
from common.errors import InputError  # noqa: E402
from depthdiag.cli import main  # noqa: E402
from diag.in_training.monitor import MONITOR_FILE, MONITOR_SALT, UpdateMonitor, monitor_batch_seed  # noqa: E402
from trainer.config import MonitorConfig, RunConfig, load_config  # noqa: E402
from trainer.data.sources import build_source  # noqa: E402
from trainer.flops import update_flops  # noqa: E402
from trainer.loss import clip_gradients_, training_loss  # noqa: E402
from trainer.machine import machine
from trainer.model import LoopedTransformer  # noqa: E402
from trainer.optim import lr_at  # noqa: E402
from trainer.rng import seeded_generator  # noqa: E402
from trainer.run_setup import _config_differences  # noqa: E402
from trainer.schedules import parse_schedule  # noqa: E402
from trainer.train import TrainStep, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MONITOR = ["monitor.every=3", "monitor.eval_sequences=4", "monitor.serving_depths=[1,2,3,4]"]
"""A monitor small enough for tests: checks after 3, 6 (the switch of tiny_config), 9 and 12 updates."""


def monitored(config: RunConfig, *more: str) -> RunConfig:
    return config.with_overrides([*MONITOR, "monitor.update_depths=[2,4]", *more])


def train_monitored(config: RunConfig, run_dir: Path, **kwargs):
    return train(config, run_dir, monitor=UpdateMonitor(config, run_dir), progress=False, **kwargs)


# --- the config -----------------------------------------------------------------------------


def test_a_config_without_a_monitor_serialises_as_before_and_one_with_it_round_trips():
    tiny = load_config(ROOT / "configs/tiny.toml")
    assert tiny.monitor == MonitorConfig() and not tiny.monitor.enabled
    assert "monitor" not in tiny.to_dict() and '"monitor"' not in tiny.to_json()
    with_monitor = load_config(ROOT / "configs/tiny-monitor.toml")
    assert with_monitor.monitor.enabled and with_monitor.to_dict()["monitor"]["every"] == with_monitor.monitor.every
    assert RunConfig.from_json(with_monitor.to_json()) == with_monitor
    # tiny-monitor trains exactly tiny: only the [monitor] block differs.
    assert {k: v for k, v in with_monitor.to_dict().items() if k != "monitor"} == tiny.to_dict()
    assert tiny.with_overrides(["monitor.every=5"]).monitor.every == 5
    # tiny-fp32 trains tiny in fp32.
    assert load_config(ROOT / "configs/tiny-fp32.toml") == tiny.with_overrides(['train.precision="fp32"'])
    # A resume that turns the monitor on (or changes it) is refused like any other config change.
    assert _config_differences(tiny, tiny.with_overrides(["monitor.every=5"])) == ["monitor.every: 0 -> 5"]


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("monitor.every=-1", "monitor.every must be >= 0"),
        ("monitor.batches=0", "monitor.batches must be >= 1"),
        ("monitor.eval_sequences=0", "monitor.eval_sequences must be >= 1"),
        ("monitor.update_depths=[4]", "at least two depths"),
        ("monitor.update_depths=[4,4]", "must not repeat"),
        ("monitor.serving_depths=[0,1]", "depths in 1..64"),
        ("monitor.serving_depths=[]", "must not be empty"),
        ("monitor.eval_set='train'", "monitor.eval_set must be one of"),
        ("monitor.every=1.5", "monitor.every must be int"),
    ],
)
def test_bad_monitor_settings_are_refused(assignment, message):
    with pytest.raises(InputError, match=message):
        load_config(ROOT / "configs/tiny.toml", [assignment])


def test_attribute_evaluation_needs_bios(tmp_path):
    with pytest.raises(InputError, match="monitor.eval_set='attributes' needs data.source='bios'"):
        tiny_config(text_corpus(tmp_path)).with_overrides(["monitor.eval_set='attributes'"])


# --- training with the monitor is training without it ----------------------------------------


@pytest.mark.parametrize(
    "schedule, precision",
    [
        ("fixed-first:k0=2,switch=0.5,finish=uniform:1-4", "fp32"),
        ("fixed-first:k0=2,switch=0.5,finish=uniform:1-4", "bf16"),
        ("uniform:1-4", "fp32"),
    ],
)
def test_training_with_the_monitor_equals_training_without_it(tmp_path, schedule, precision):
    config = tiny_config(text_corpus(tmp_path), schedule=schedule, precision=precision)  # 12 updates
    plain, watched = tmp_path / "plain", tmp_path / "watched"
    summary = train(config, plain, progress=False)
    watched_summary = train_monitored(monitored(config), watched)

    assert without_wall_time(watched) == without_wall_time(plain)
    assert watched_summary.final_loss == summary.final_loss
    written = sorted(p.relative_to(plain) for p in plain.rglob("*.pt"))
    assert written == sorted(p.relative_to(watched) for p in watched.rglob("*.pt"))
    for relative in written:
        a, b = torch.load(plain / relative, weights_only=True), torch.load(watched / relative, weights_only=True)
        a.pop("config"), b.pop("config")  # b's config has the [monitor] block; the rest, RNG states included, is equal
        progress_a, progress_b = a.pop("progress", None), b.pop("progress", None)
        assert_same_payload(a, b, str(relative))
        if progress_a is not None:
            assert (progress_a["tokens"], progress_a["flops"]) == (progress_b["tokens"], progress_b["flops"])

    ds = open_monitor(watched / MONITOR_FILE)
    switch = parse_schedule(schedule, seed=0, total_updates=12).switch_step
    assert ds["step"].values.tolist() == sorted({3, 6, 9, 12} | ({switch} if switch else set()))
    assert ds.attrs["switch_step"] == (switch if switch is not None else -1)
    assert ds.attrs["precision"] == precision and RunConfig.from_json(ds.attrs["config"]) == monitored(config)
    assert json.loads(ds.attrs["machine"]) == machine("cpu")  # the kernels that computed the checks
    assert ds["lr"].values.tolist() == [lr_at(int(s), config.optim, 12) for s in ds["step"].values]
    assert ds.sizes == {"step": ds.sizes["step"], "batch": 2, "update_depth": 2, "serving_depth": 4, "depth": 4}
    probability = ds["depth_probability"].values
    np.testing.assert_allclose(probability.sum(axis=1), 1.0)
    if switch is not None:
        assert probability[0].tolist() == [0.0, 1.0, 0.0, 0.0]  # step 3: fixed K0 = 2
    np.testing.assert_allclose(probability[-1], 0.25)  # step 12: uniform 1..4
    for name in MONITOR_VARIABLES:
        assert np.isfinite(ds[name].values).all(), name
        assert ds[name].attrs["long_name"] and ds[name].attrs["units"], name
    np.testing.assert_array_equal(
        ds["benefit"].values, ds["nll"].isel(update_depth=0).values - ds["nll"].isel(update_depth=-1).values
    )


def test_a_check_touches_no_process_state_and_draws_batches_of_its_own(tmp_path):
    config = monitored(tiny_config(text_corpus(tmp_path)))
    torch.manual_seed(0)
    model = LoopedTransformer(config.model)
    step = TrainStep.for_run(model, config)
    source = build_source(config.data)
    for s in range(2):
        step(source.batch(0, s, 8, 16), 2, 1e-3)
    monitor = UpdateMonitor(config, tmp_path / "run")
    monitor.resume(0)

    # The engine itself draws no random number and restores what it changes.
    torch.manual_seed(123)
    before = torch.get_rng_state()
    monitor.check(3, model, step.optimizer)
    assert torch.equal(torch.get_rng_state(), before)

    # The hook: RNGs, grad mode, module modes, weights and optimizer state exactly as they were.
    np.random.seed(5)
    random.seed(5)
    model.train()
    model.core[0].eval()
    modes = [m.training for m in model.modules()]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer_state = json.dumps(step.optimizer.state_dict()["param_groups"])
    moments = {k: {n: t.clone() for n, t in v.items()} for k, v in step.optimizer.state_dict()["state"].items()}
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    with torch.no_grad():
        monitor.after_update(3, model, step.optimizer)
        assert not torch.is_grad_enabled()
    assert (tmp_path / "run" / MONITOR_FILE).is_file()
    assert torch.equal(torch.get_rng_state(), states[0])
    assert np.array_equal(np.random.get_state()[1], states[1]) and random.getstate() == states[2]
    assert not torch.is_autocast_enabled("cpu")
    assert [m.training for m in model.modules()] == modes
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert json.dumps(step.optimizer.state_dict()["param_groups"]) == optimizer_state
    assert_same_payload(moments, step.optimizer.state_dict()["state"])

    # Its batches: a pure function of (train.seed, step, index), never the training batches.
    batches = monitor.batches(3)
    assert len(batches) == 2 and batches[0].shape == (8, 17)
    assert all(torch.equal(a, b) for a, b in zip(batches, UpdateMonitor(config, tmp_path / "other").batches(3)))
    assert not any(torch.equal(b, source.batch(0, s, 8, 16)) for b in batches for s in range(12))
    assert not torch.equal(batches[0], batches[1]) and not torch.equal(batches[0], monitor.batches(6)[0])
    assert monitor_batch_seed(0, 3) != monitor_batch_seed(1, 3)


@pytest.mark.filterwarnings("ignore::diag.BiasCorrectionWarning")  # 3 updates: Adam is young
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_check_is_compare_updates_on_the_runs_state_batches_and_settings(tmp_path, precision):
    clip = 0.5
    config = monitored(tiny_config(text_corpus(tmp_path), precision=precision), f"optim.grad_clip={clip}")
    tc, mc = config.train, config.monitor
    torch.manual_seed(0)
    model = LoopedTransformer(config.model)
    step = TrainStep.for_run(model, config)
    source = build_source(config.data)
    for s in range(3):
        step(source.batch(tc.seed, s, tc.batch_size, tc.seq_len), 2, lr_at(s, config.optim, tc.updates))
    monitor = UpdateMonitor(config, tmp_path / "run")
    monitor.resume(0)
    monitor.after_update(3, model, step.optimizer)
    check = open_monitor(tmp_path / "run" / MONITOR_FILE).sel(step=3)
    assert check.sizes["batch"] == mc.batches

    # The check's inputs rebuilt from the monitor's documented rules, not through its own methods:
    # batch i from seed seeded_generator(train.seed, step, MONITOR_SALT).integers(2**63), and a text
    # run's held-out evaluation set at monitor.eval_sequences rows.
    seed = int(seeded_generator(tc.seed, 3, MONITOR_SALT).integers(2**63))
    eval_tokens = source.eval_tokens(mc.eval_sequences, tc.seq_len)
    settings = {
        "update_depths": mc.update_depths,
        "serving_depths": mc.serving_depths,
        "lr": lr_at(3, config.optim, tc.updates),
        "grad_clip": clip,
        "precision": precision,
    }
    for i in range(mc.batches):
        batch = source.batch(seed, i, tc.batch_size, tc.seq_len)
        unit = diag.compare_updates(model, step.optimizer, batch, eval_tokens, **settings)
        # The same code on the same numbers: equal to the bit, after the file's round trip too.
        for name in unit.data_vars:
            np.testing.assert_array_equal(check.sel(batch=i)[name].values, unit[name].values, err_msg=name)
        # The clip binds (measured norms 1.6-1.7 against 0.5), so a check that dropped it would differ.
        for depth in mc.update_depths:
            unclipped = copy.deepcopy(model)
            training_loss(unclipped, batch, depth, precision=precision).backward()
            assert float(clip_gradients_([p.grad for p in unclipped.parameters()], 0.0)) > 2 * clip
    if precision == "bf16":
        # bf16 moves the numbers (measured: NLL by 2e-5 to 3e-4), so a check run in fp32 would differ.
        in_fp32 = diag.compare_updates(model, step.optimizer, batch, eval_tokens, **{**settings, "precision": "fp32"})
        assert not np.array_equal(in_fp32["nll"].values, unit["nll"].values)


def test_a_killed_and_resumed_run_writes_the_same_monitor_file(tmp_path, monkeypatch):
    config = monitored(tiny_config(text_corpus(tmp_path)), "monitor.every=2")  # checkpoints every 4
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_monitored(config, straight)

    import trainer.train as train_module

    monkeypatch.setattr(train_module, "update_flops", Interrupt(update_flops, 7))  # dies in update 7
    with pytest.raises(KeyboardInterrupt):
        train_monitored(config, resumed)
    monkeypatch.undo()
    # The checks after 6 updates outlived the newest checkpoint (4 updates): the resume drops them.
    assert open_monitor(resumed / MONITOR_FILE)["step"].values.tolist() == [2, 4, 6]
    assert train_module.latest_checkpoint(resumed).name == "step_000004.pt"
    train_monitored(config, resumed, resume=True)

    a, b = open_monitor(straight / MONITOR_FILE), open_monitor(resumed / MONITOR_FILE)
    assert a["step"].values.tolist() == [2, 4, 6, 8, 10, 12]
    assert a.attrs == b.attrs
    for name in list(a.data_vars) + list(a.coords):
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name].values, b[name].values), name
    assert without_wall_time(resumed) == without_wall_time(straight)

    # A finished run resumed again recomputes its last check and changes nothing.
    train_monitored(config, resumed, resume=True)
    xr.testing.assert_identical(open_monitor(resumed / MONITOR_FILE), b)


def test_a_resume_refuses_a_monitor_file_of_another_run(tmp_path):
    config = monitored(tiny_config(text_corpus(tmp_path), updates=4, snapshot_uniform_updates=[]))
    train_monitored(config, tmp_path / "a")
    other = monitored(tiny_config(text_corpus(tmp_path), updates=4, snapshot_uniform_updates=[], seed=1))
    train_monitored(other, tmp_path / "b")
    (tmp_path / "b" / MONITOR_FILE).replace(tmp_path / "a" / MONITOR_FILE)
    with pytest.raises(InputError, match="another config"):
        train_monitored(config, tmp_path / "a", resume=True)


def test_a_refused_monitor_write_fails_the_run_naming_the_file(tmp_path, monkeypatch):
    import diag.in_training.monitor as monitor_module
    from common.errors import RunFailed

    def full_disk(ds, path):
        raise OSError(28, "No space left on device", str(path))

    config = monitored(tiny_config(text_corpus(tmp_path)))
    monkeypatch.setattr(monitor_module, "write_dataset", full_disk)
    with pytest.raises(RunFailed, match=r"step 3: writing .*monitor\.h5 failed \(No space left on device\)"):
        train_monitored(config, tmp_path / "run")


# --- analysis: the numbers, the figure, the commands -------------------------------------------


def monitor_dataset(steps=(100, 200, 300, 400), n_batches: int = 3, n_depths: int = 5, switch: int = 300):
    rng = np.random.default_rng(0)
    shape = (len(steps), n_batches, n_depths)
    benefit = np.linspace(0.0, 0.3, n_depths) * (np.array(steps) >= switch)[:, None, None] + rng.normal(0, 0.02, shape)
    nll_deep = rng.normal(3.0, 0.1, shape)
    nll = np.stack([nll_deep + benefit, nll_deep], axis=2)
    return xr.Dataset(
        {
            "nll": (("step", "batch", "update_depth", "serving_depth"), nll),
            "nll_before": (("step", "serving_depth"), nll_deep.mean(axis=1)),
            "benefit": (("step", "batch", "serving_depth"), benefit),
            "update_rms": (("step", "batch", "update_depth"), np.full(shape[:2] + (2,), 1e-3)),
            "rms_scale": (("step", "batch", "update_depth"), np.ones(shape[:2] + (2,))),
            "train_loss": (("step", "batch", "update_depth"), np.full(shape[:2] + (2,), 3.0)),
            "update_cosine": (("step", "batch"), np.full(shape[:2], 0.9)),
            "lr": (("step",), np.full(len(steps), 1e-3)),
            "depth_probability": (("step", "depth"), np.full((len(steps), 4), 0.25)),
        },
        coords={
            "step": np.array(steps),
            "batch": np.arange(n_batches),
            "update_depth": [4, 16],
            "serving_depth": np.arange(1, n_depths + 1),
            "depth": np.arange(1, 5),
        },
        attrs={"kind": "monitor", "switch_step": switch, "schedule": "fixed-first:k0=4,switch=0.75"},
    )


def test_monitor_numbers_are_batch_means_and_t_intervals_over_batches():
    ds = monitor_dataset()
    np.testing.assert_allclose(monitor_benefit_map(ds).values, ds["benefit"].values.mean(axis=1))
    intervals = monitor_depth_averaged_benefit(ds)
    assert intervals.attrs["unit"] == "batch" and intervals["mean"].dims == ("step",)
    per_batch = ds["benefit"].values.mean(axis=2)  # [step, batch]
    for index in range(ds.sizes["step"]):
        mean, lower, upper, n = t_interval(per_batch[index])
        assert (float(intervals["mean"][index]), int(intervals["n"][index])) == (pytest.approx(mean), n)
        assert float(intervals["lower"][index]) == pytest.approx(lower)
    rows = monitor_summary_table(ds, options=IntervalOptions(level=0.9))
    assert [r["phase"] for r in rows] == ["fixed", "fixed", "switch", "finish"]
    assert rows[-1]["excludes_zero"] and rows[-1]["mean"] == pytest.approx(per_batch[-1].mean())


def test_monitor_figure_draws_the_map_and_the_trend_with_the_switch():
    ds = monitor_dataset()
    ax = plot_monitor_heatmap(monitor_benefit_map(ds), switch_step=300)
    mesh = next(c for c in ax.collections if isinstance(c, QuadMesh))
    np.testing.assert_allclose(np.asarray(mesh.get_array()).reshape(5, 4), monitor_benefit_map(ds).values.T)
    assert any(list(line.get_xdata()) == [300, 300] for line in ax.lines)
    intervals = monitor_depth_averaged_benefit(ds)
    trend = plot_monitor_trend(intervals, switch_step=300)
    assert np.allclose(trend.lines[0].get_ydata(), intervals["mean"].values)
    assert "3 batches of one run" in trend.get_title()
    fig = monitor_figure(ds)
    assert len(fig.axes) == 3  # two panels and the colour bar


def test_monitor_file_is_told_apart_from_results_files(tmp_path):
    from analysis.monitor import validate_monitor
    from analysis.store import write_dataset

    write_dataset(monitor_dataset(), tmp_path / "monitor.h5")
    assert is_monitor_file(tmp_path / "monitor.h5")
    assert not is_monitor_file(tmp_path / "absent.h5")
    broken = monitor_dataset().drop_vars("lr")
    with pytest.raises(InputError, match="no variable 'lr'"):
        validate_monitor(broken, "x.h5")


def test_cli_trains_with_a_monitor_block_then_summarizes_and_plots_it(tmp_path):
    corpus = text_corpus(tmp_path)
    config_file = tmp_path / "run.toml"
    config_file.write_text(
        "[model]\nvocab_size = 256\nmax_seq_len = 16\nd_model = 32\nn_heads = 2\n"
        f'[data]\nsource = "text"\npath = "{corpus}"\neval_sequences = 2\n'
        '[train]\nschedule = "fixed-first:k0=2,switch=0.5,finish=uniform:1-4"\nupdates = 8\nbatch_size = 4\n'
        'seq_len = 16\ndevice = "cpu"\nsnapshot_uniform_updates = []\n'
        "[monitor]\nevery = 2\nbatches = 3\nupdate_depths = [2, 4]\nserving_depths = [1, 2, 3]\neval_sequences = 2\n"
    )
    runner = CliRunner()
    run_dir = tmp_path / "run"
    trained = runner.invoke(main, ["train", str(config_file), "--out", str(run_dir), "--no-progress"])
    assert trained.exit_code == 0, trained.output
    monitor_file = run_dir / MONITOR_FILE
    assert open_monitor(monitor_file)["step"].values.tolist() == [2, 4, 6, 8]

    summary = runner.invoke(main, ["summarize", str(monitor_file)])
    assert summary.exit_code == 0, summary.output
    assert "over the check's batches of one run (n = 3)" in summary.output
    assert [line.split()[:2] for line in summary.output.splitlines()[3:]] == [
        ["2", "fixed"],
        ["4", "switch"],
        ["6", "finish"],
        ["8", "finish"],
    ]
    as_json = json.loads(runner.invoke(main, ["summarize", str(monitor_file), "--json"]).output)
    assert [row["step"] for row in as_json["rows"]] == [2, 4, 6, 8] and as_json["switch_step"] == 4

    figure = tmp_path / "monitor.png"
    drawn = runner.invoke(main, ["plot", str(monitor_file), "--figure", "monitor", "--out", str(figure)])
    assert drawn.exit_code == 0, drawn.output
    assert figure.is_file() and figure.with_suffix(".pdf").is_file()
    wrong = runner.invoke(main, ["plot", str(monitor_file), "--out", str(tmp_path / "f4.png")])
    assert wrong.exit_code == 2 and "--figure 4 draws results files" in wrong.stderr


# 13 s: two DDP processes stay in make test (test_distributed.py), and the FSDP2 run of
# test_fsdp.py writes the monitor file of one process from rank 0.
@pytest.mark.slow
def test_ddp_rank_zero_writes_the_monitor_file_of_one_process(tmp_path):
    """Under DDP rank 0 checks alone and writes: the file of one process."""
    corpus = tmp_path / "corpus.txt"
    rng = random.Random(2)
    corpus.write_text(" ".join(rng.choice("one two three four five six seven".split()) for _ in range(3000)))
    config_path = tmp_path / "run.toml"
    config_path.write_text(
        DDP_CONFIG.format(corpus=corpus).replace("[train]\n", '[train]\nparallel = "ddp"\n')
        + "\n[monitor]\nevery = 4\nbatches = 2\nupdate_depths = [2, 4]\nserving_depths = [1, 2, 3, 4]\n"
        + "eval_sequences = 4\n"
    )
    result = torchrun_train(config_path, tmp_path / "ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    config = load_config(config_path)
    assert config.train.parallel == "ddp"
    train_monitored(config, tmp_path / "single")

    ranks, single = open_monitor(tmp_path / "ddp" / MONITOR_FILE), open_monitor(tmp_path / "single" / MONITOR_FILE)
    assert ranks["step"].values.tolist() == single["step"].values.tolist() == [4, 8]
    # The gradient reductions over ranks round differently: the same numbers to float tolerance.
    np.testing.assert_allclose(ranks["nll"].values, single["nll"].values, rtol=1e-4)
    np.testing.assert_allclose(ranks["benefit"].values, single["benefit"].values, atol=1e-4)
    np.testing.assert_allclose(ranks["update_cosine"].values, single["update_cosine"].values, atol=1e-4)
    assert not list((tmp_path / "ddp").rglob("*.tmp*"))
