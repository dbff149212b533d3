"""What every command shares: exit codes and one-line errors (DESIGN section 1)."""

from click.testing import CliRunner

from common.errors import InputError
from diag.cli import main


def run(*args):
    result = CliRunner().invoke(main, list(args))
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
