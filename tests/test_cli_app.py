"""depthdiag/cli/app.py, what every command shares: exit codes and one-line errors (docs/cli.md)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
from click.testing import CliRunner
from helpers import TOY_CONFIG, sigint_at_its_default, start_holder

from common.errors import InputError
from depthdiag.cli import main
from trainer.checkpoint import latest_checkpoint
from trainer.machine import machine


def run(*args):
    result = CliRunner().invoke(main, list(args), prog_name="depthdiag")
    return result.exit_code, result.stdout, result.stderr


def test_debug_shows_the_traceback_of_bad_input():
    result = CliRunner().invoke(main, ["--debug", "flops", "configs/tiny.toml", "--schedule", "fixed:0"])
    assert result.exit_code == 1 and isinstance(result.exception, InputError)


def test_a_value_error_from_a_bug_is_not_reported_as_bad_input(monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("a bug inside a library call")

    monkeypatch.setattr("trainer.flops.flops_report", broken)
    result = CliRunner().invoke(main, ["flops", "configs/tiny.toml"])
    assert result.exit_code == 1 and isinstance(result.exception, ValueError)
    assert "error:" not in result.stderr


def test_an_output_under_a_regular_file_is_one_line_and_exit_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, out, err = run("train", "configs/tiny.toml", "--out", str(blocker / "run"), "--no-progress")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and str(blocker) in err and "Traceback" not in err


def run_limited(*args, max_file_bytes: int, cwd):
    """`depthdiag ARGS` in a subprocess whose files may not grow past `max_file_bytes`."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return subprocess.run(
        [sys.executable, "-m", "depthdiag", *args], cwd=cwd, preexec_fn=limit, capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("toy")
    (directory / "toy.toml").write_text(TOY_CONFIG)
    code, _, err = run("train", str(directory / "toy.toml"), "--out", str(directory / "run"), "--no-progress")
    assert code == 0, err
    return directory


def test_diagnose_over_a_file_size_limit_is_one_line_and_exit_2(toy_run, tmp_path):
    snapshot = sorted((toy_run / "run" / "snapshots").glob("*.pt"))[0]
    out = tmp_path / "results.h5"
    args = ["diagnose", str(snapshot), "--out", str(out), "--batches", "1", "--update-depths", "2,8"]
    result = run_limited(*args, "--serving", "1-8", "--no-progress", max_file_bytes=20_000, cwd=Path.cwd())
    assert result.returncode == 2, result.stderr  # it was a segmentation fault (139) in HDF5's close
    error_lines = [line for line in result.stderr.splitlines() if not line.startswith("warning:")]
    assert len(error_lines) == 1 and "File too large" in error_lines[0] and str(tmp_path) in error_lines[0]
    assert not out.exists() and not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]


def test_training_over_a_file_size_limit_fails_the_run_with_exit_3(toy_run, tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", str(toy_run / "toy.toml"), "--out", str(run_dir), "--no-progress"]
    result = run_limited(*args, max_file_bytes=20_000, cwd=Path.cwd())
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("\n") == 1 and "File too large" in result.stderr and "step " in result.stderr
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name]


def test_eval_out_takes_the_lock_and_refuses_an_existing_file_unless_forced(toy_run, tmp_path):
    snapshot = sorted((toy_run / "run" / "snapshots").glob("*.pt"))[0]
    out = tmp_path / "eval.h5"
    args = ["eval", str(snapshot), "--serving", "1-2", "--out", str(out), "--no-progress"]
    runner = CliRunner()
    assert runner.invoke(main, args).exit_code == 0
    with h5py.File(out, "r") as written:  # what computed the NLLs
        assert json.loads(written.attrs["machine"]) == machine("cpu")
    first = out.read_bytes()
    result = runner.invoke(main, args)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"depthdiag: error: {out}: already exists; pass --force to overwrite it"
    ]
    assert out.read_bytes() == first
    holder = start_holder(out)
    try:
        result = runner.invoke(main, [*args, "--force"])
        assert result.exit_code == 2 and f"pid {holder.pid}" in result.stderr and str(out) in result.stderr
    finally:
        holder.kill()
        holder.wait()
    assert runner.invoke(main, [*args, "--force"]).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.h5"]
    result = runner.invoke(main, ["eval", str(snapshot), "--serving", "1-65", "--no-progress"])
    assert result.exit_code == 2 and "--max-depth" in result.stderr


# A real SIGTERM (Terminated, a KeyboardInterrupt) in make test; a real SIGINT takes the same
# `except KeyboardInterrupt` path with Python's own handler, and the SIGINT line and exit 130 are
# checked in process (test_an_interrupt_outside_a_commands_work_and_under_debug): slow.
@pytest.mark.parametrize(
    "signum, code", [pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow), (signal.SIGTERM, 143)]
)
def test_an_interrupt_exits_130_or_143_with_one_line_keeping_the_checkpoints(tmp_path, signum, code):
    config = tmp_path / "long.toml"
    long = TOY_CONFIG.replace("updates = 40", "updates = 100000").replace(
        "checkpoint_every = 0", "checkpoint_every = 5"
    )
    config.write_text(long)
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "depthdiag", "train", str(config), "--out", str(run_dir), "--no-progress"],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_at_its_default,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == code, err
    name = "SIGINT" if signum == signal.SIGINT else "SIGTERM"
    newest = latest_checkpoint(run_dir)
    assert err.splitlines() == [
        f"depthdiag: interrupted ({name}): {run_dir} keeps its checkpoints, the newest {newest.name}; "
        f"resume with: depthdiag train {config} --resume {run_dir}"
    ]
    leftovers = [p for p in tmp_path.rglob("*") if p.name.startswith(".")]
    assert leftovers == []  # no temporaries, no lock file


@pytest.mark.parametrize(
    "args, problem",
    [
        (["train", "--bogus"], "depthdiag train: No such option '--bogus'"),
        (["diagnose", "a.pt"], "depthdiag diagnose: Missing option '--out'"),
        (["summarize", "--level", "x", "r.h5"], "depthdiag summarize: Invalid value for '--level'"),
        (["no-such-command"], "depthdiag: No such command 'no-such-command'"),
        (["grid", "run"], "depthdiag grid run: Missing argument 'GRID'"),
    ],
)
def test_a_usage_error_is_one_line_and_exit_2(args, problem):
    code, out, err = run(*args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"depthdiag: error: {problem}") and "--help)" in err


@pytest.mark.parametrize("command", ["eval", "diagnose", "summarize", "export"])
def test_a_symbolic_link_loop_is_named_as_one_not_as_a_missing_file(tmp_path, command):
    loop = tmp_path / "a.pt"
    loop.symlink_to(tmp_path / "b.pt")
    (tmp_path / "b.pt").symlink_to(loop)
    extra = {"diagnose": ["--out", str(tmp_path / "r.h5")], "export": ["--out", str(tmp_path / "x")]}
    code, out, err = run(command, str(loop), *extra.get(command, []))
    assert code == 2 and err == f"depthdiag: error: {loop}: symbolic link loop (a link that leads back to itself)\n"


def test_an_interrupt_outside_a_commands_work_and_under_debug(monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("trainer.flops.flops_report", interrupted)
    code, out, err = run("flops", "configs/tiny.toml")
    assert code == 130 and err.splitlines()[-1].startswith("depthdiag: interrupted (SIGINT): nothing was written")
    with pytest.raises(KeyboardInterrupt):  # --debug: the interrupt itself, with its traceback
        CliRunner().invoke(main, ["--debug", "flops", "configs/tiny.toml"], prog_name="depthdiag")


def test_a_bare_group_shows_its_help_not_an_error_line():
    for args in ([], ["grid"]):
        code, out, err = run(*args)
        assert "Usage:" in out + err and "error:" not in err


def test_the_resume_advice_repeats_the_overrides(tmp_path):
    from depthdiag.cli.train import _train_kept

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_000004.pt").write_bytes(b"")
    line = _train_kept(str(tmp_path / "my config.toml"), str(tmp_path / "run"), ("train.seed=3",), None)
    assert line.endswith(
        f"resume with: depthdiag train '{tmp_path}/my config.toml' --set train.seed=3 --resume {tmp_path}/run"
    )
