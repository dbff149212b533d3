"""The output rule (common/outputs.py): no command overwrites one of its inputs, an existing
output needs --force, and --force replaces only an output of the same kind that depthdiag
wrote. The pure rule first, then every command that writes, through the CLI."""

import os

import pytest
from click.testing import CliRunner
from helpers import TOY_CONFIG

from common.errors import InputError
from common.outputs import OutputKind, check_output, empty_folder

NOTE = OutputKind("note", lambda path: path.is_file() and path.read_text() == "ours")
FOLDER = OutputKind("folder", lambda path: (path / "ours").is_file(), folder=True)


def test_an_output_that_is_an_input_is_refused_by_any_name(tmp_path):
    given = tmp_path / "in.txt"
    given.write_text("ours")
    (tmp_path / "alias.txt").symlink_to(given)
    os.link(given, tmp_path / "hard.txt")
    for name in (given, tmp_path / "alias.txt", tmp_path / "." / "in.txt", tmp_path / "hard.txt"):
        with pytest.raises(InputError, match=f"^{name}: is an input of this command"):
            check_output(name, kind=NOTE, inputs=[given], force=True)


def test_a_folder_output_that_holds_an_input_is_refused(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "sub" / "a.txt").write_text("text")
    with pytest.raises(InputError, match=f"^{corpus}: holds an input of this command"):
        check_output(corpus, kind=FOLDER, inputs=[corpus / "sub" / "a.txt"], force=True)
    # A file output beside the input, or a folder output inside the input's folder, is fine.
    check_output(corpus / "sub" / "out", kind=FOLDER, inputs=[corpus / "sub" / "a.txt"], force=False)
    check_output(tmp_path / "corpus-x", kind=FOLDER, inputs=[corpus / "sub" / "a.txt"], force=False)


def test_force_replaces_only_what_depthdiag_wrote(tmp_path):
    ours, theirs = tmp_path / "ours.txt", tmp_path / "theirs.txt"
    ours.write_text("ours")
    theirs.write_text("a stranger's file")
    with pytest.raises(InputError, match=f"^{ours}: already exists; pass --force"):
        check_output(ours, kind=NOTE, force=False)
    check_output(ours, kind=NOTE, force=True)
    with pytest.raises(InputError, match=f"^{theirs}: exists and is not a note depthdiag wrote"):
        check_output(theirs, kind=NOTE, force=True)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(InputError, match="already exists"):
        check_output(dangling, kind=NOTE, force=False)


def test_an_empty_folder_counts_as_absent_for_a_folder_output(tmp_path):
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", kind=FOLDER, force=False)
    (tmp_path / "empty" / "x").write_text("")
    with pytest.raises(InputError, match="already exists"):
        check_output(tmp_path / "empty", kind=FOLDER, force=False)


def test_empty_folder_keeps_the_folder_and_its_symlink(tmp_path):
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (real / "a").write_text("1")
    (tmp_path / "link").symlink_to(real)
    empty_folder(tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and list(real.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no temporary left


# --- every command that writes --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "toy.toml"
    path.write_text(TOY_CONFIG.replace("checkpoint_every = 0", "checkpoint_every = 20"))
    return path


@pytest.fixture(scope="module")
def tiny_run(tiny_config):
    run_dir = tiny_config.parent / "run"
    result = _run("train", tiny_config, "--out", run_dir, "--no-progress")
    assert result.exit_code == 0, result.output
    return run_dir


@pytest.fixture(scope="module")
def results_file(tiny_run):
    out = tiny_run.parent / "results.h5"
    snapshots = sorted((tiny_run / "snapshots").glob("*.pt"))
    result = _run("diagnose", *snapshots, "--out", out, "--batches", "2", "--serving", "1-4", "--no-progress")
    assert result.exit_code == 0, result.output
    return out


def _run(*args):
    from depthdiag.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("depthdiag: error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_prepare_never_deletes_the_corpus_it_reads(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    book = corpus / "a.txt"
    book.write_text("\n\n".join(f"paragraph {i} " * 20 for i in range(200)), encoding="utf-8")
    (corpus / "notes.md").write_text("mine")
    before = sorted(p.name for p in corpus.iterdir())
    _one_line(_run("prepare", book, "--out", corpus, "--force", "--vocab-size", 300), str(corpus), "holds an input")
    # A folder of other files is no prepared data folder, inputs or not.
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("mine")
    _one_line(
        _run("prepare", book, "--out", other, "--force", "--vocab-size", 300),
        "holds files depthdiag does not write there (x.txt)",
    )
    assert sorted(p.name for p in corpus.iterdir()) == before and (other / "x.txt").read_text() == "mine"


def test_diagnose_and_eval_never_overwrite_their_input(tmp_path, tiny_run):
    snapshot = next((tiny_run / "snapshots").glob("*.pt"))
    checkpoint = next((tiny_run / "checkpoints").glob("*.pt"))
    before = snapshot.read_bytes(), checkpoint.read_bytes()
    _one_line(_run("diagnose", snapshot, "--out", snapshot, "--force", "--batches", 1), "is an input")
    _one_line(_run("eval", checkpoint, "--out", checkpoint, "--force", "--serving", "1,2"), "is an input")
    # Another depthdiag file that is not a results file is not replaced either.
    _one_line(_run("eval", snapshot, "--out", checkpoint, "--force", "--serving", "1,2"), "is not a results file")
    assert (snapshot.read_bytes(), checkpoint.read_bytes()) == before


def test_train_refuses_a_folder_that_holds_a_start_and_force_replaces_only_a_run(tmp_path, tiny_config):
    started = tmp_path / "started"
    started.mkdir()
    (started / "config.json").write_text('{"model": {}, "train": {}}\n')
    (started / "metrics.jsonl").write_text('{"step": 0}\n')
    line = _one_line(_run("train", tiny_config, "--out", started), f"{started}: already exists")
    assert "--force" in line and (started / "metrics.jsonl").read_text() == '{"step": 0}\n'
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("mine")
    _one_line(
        _run("train", tiny_config, "--out", mine, "--force"), "holds files depthdiag does not write there (thesis.tex)"
    )
    assert (mine / "thesis.tex").read_text() == "mine"


def test_export_never_writes_into_the_folder_of_its_input(tmp_path, tiny_run):
    checkpoint = next((tiny_run / "checkpoints").glob("*.pt"))
    _one_line(_run("export", checkpoint, "--out", checkpoint.parent, "--force"), "holds an input")
    assert checkpoint.is_file()


def test_summarize_and_plot_never_overwrite_their_input_or_a_strangers_file(tmp_path, results_file):
    before = results_file.read_bytes()
    alias = tmp_path / "alias.csv"
    alias.symlink_to(results_file)
    _one_line(_run("summarize", results_file, "--csv", alias, "--force"), "is an input")
    stranger = tmp_path / "stranger.png"
    stranger.write_bytes(b"\x89PNG not ours")
    _one_line(_run("plot", results_file, "--out", stranger, "--force"), "is not a figure depthdiag wrote")
    assert stranger.read_bytes() == b"\x89PNG not ours" and results_file.read_bytes() == before
    drawn = tmp_path / "drawn.png"
    assert _run("plot", results_file, "--out", drawn).exit_code == 0
    assert _run("plot", results_file, "--out", drawn, "--force").exit_code == 0  # its own figure: replaced
    table = tmp_path / "table.csv"
    table.write_text("a,b\n1,2\n")
    _one_line(_run("summarize", results_file, "--csv", table, "--force"), "is not a summary table")


def test_force_never_deletes_hidden_files_of_yours_in_a_folder_it_would_replace(tmp_path, tiny_config, tiny_run):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    (run_dir / ".git").mkdir()
    line = _one_line(_run("train", tiny_config, "--out", run_dir, "--force"), "holds files depthdiag does not write")
    assert "(.git)" in line and (run_dir / ".git").is_dir()


def test_a_symlinked_output_stays_a_link_to_the_file_written(tmp_path, tiny_run, results_file):
    import shutil

    target = tmp_path / "elsewhere" / "table.csv"
    target.parent.mkdir()
    link = tmp_path / "table.csv"
    assert _run("summarize", results_file, "--csv", target).exit_code == 0
    link.symlink_to(target)
    target.write_text(target.read_text() + "an older table\n")
    assert _run("summarize", results_file, "--csv", link, "--force").exit_code == 0
    assert link.is_symlink() and "an older table" not in target.read_text()
    folder = tmp_path / "exports"
    folder.mkdir()
    (tmp_path / "export-link").symlink_to(folder)
    checkpoint = next((tiny_run / "checkpoints").glob("step_*.pt"))
    for flags in ([], ["--force"]):
        assert _run("export", checkpoint, "--out", tmp_path / "export-link", *flags).exit_code == 0
        assert (tmp_path / "export-link").is_symlink() and (folder / "model.safetensors").is_file()
    shutil.rmtree(folder)


def test_empty_folder_finishes_before_an_interrupt_takes_effect(tmp_path, monkeypatch):
    import signal

    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("a", "b", "c"):
        (folder / name).write_text(name)
    real_replace = os.replace

    def interrupted_replace(source, target):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C after the first entry has moved
        monkeypatch.setattr(os, "replace", real_replace)
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", interrupted_replace)
    # Ctrl-C's own handler, also where this process was started with SIGINT ignored (a background
    # command of a shell without job control), in which case raising it would do nothing.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            empty_folder(folder)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert list(folder.iterdir()) == [] and [p.name for p in tmp_path.iterdir()] == ["run"]


def test_diagnose_force_discards_only_a_parts_folder_diagnose_wrote(tmp_path, tiny_run):
    snapshot = next((tiny_run / "snapshots").glob("*.pt"))
    out = tmp_path / "r.h5"
    parts = tmp_path / "r.h5.parts"
    parts.mkdir()
    (parts / "thesis.tex").write_text("mine")
    _one_line(
        _run("diagnose", snapshot, "--out", out, "--force", "--batches", 1),
        f"{parts}: exists and is not a diagnose parts",
    )
    assert (parts / "thesis.tex").read_text() == "mine"
