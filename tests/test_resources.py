"""trainer/resources.py: a run that clearly cannot fit in memory is refused before anything is
allocated or written; and the bootstrap's resamples are bounded."""

import pytest
import torch
from click.testing import CliRunner
from helpers import text_corpus, tiny_config

from analysis.stats import IntervalOptions
from common.choices import RESAMPLES_RANGE
from common.errors import InputError
from depthdiag.cli import main
from trainer.config import load_config
from trainer.model import LoopedTransformer
from trainer.resources import check_memory, training_memory
from trainer.train import train

GB = 10**9


@pytest.mark.parametrize(
    "overrides, bytes_per_parameter",
    [
        ([], 16),  # fp32 weights and gradients, AdamW's two moments
        (["model.tie_embeddings=true", "model.mlp='swiglu'", "model.norm='sandwich'"], 16),
        (["optim.name='sgd'"], 12),  # one momentum buffer
        (["optim.name='sgd'", "optim.momentum=0.0"], 8),  # none
    ],
)
def test_the_model_part_counts_the_parameters_of_the_built_model(overrides, bytes_per_parameter):
    config = load_config("configs/tiny.toml", overrides)
    model = LoopedTransformer(config.model)
    parameters = sum(p.numel() for p in model.parameters())  # a tied matrix once
    rotary = sum(b.numel() * b.element_size() for b in model.buffers())
    need = training_memory(config)
    assert need.parameters == parameters
    assert need.model_bytes == bytes_per_parameter * parameters + rotary


def test_the_batch_and_activation_parts_are_this_process_share():
    config = load_config("configs/tiny.toml", ["train.batch_size=64"])
    alone, one_of_four = training_memory(config), training_memory(config, world_size=4)
    assert alone.batch_bytes == 64 * 65 * 8  # int64 [B, T+1]
    assert one_of_four.batch_bytes == 16 * 65 * 8
    assert one_of_four.activation_bytes * 4 == alone.activation_bytes
    assert one_of_four.model_bytes == alone.model_bytes


def test_the_tiny_run_fits_in_a_gigabyte():
    check_memory(load_config("configs/tiny.toml"), torch.device("cpu"), available=GB)


@pytest.mark.parametrize(
    "override, named",
    [
        ("model.d_model=1000000", "model.d_model=1000000"),
        ("model.vocab_size=100000000000", "model.vocab_size=100000000000"),
        ("train.batch_size=1000000000", "train.batch_size=1000000000"),
        ("data.eval_sequences=10000000000", "data.eval_sequences=10000000000"),
    ],
)
def test_a_run_that_cannot_fit_is_refused_naming_the_key_and_the_limit(override, named):
    config = load_config("configs/tiny.toml", [override])
    with pytest.raises(InputError) as err:
        check_memory(config, torch.device("cpu"), available=23 * GB, source="configs/tiny.toml")
    message = str(err.value)
    assert message.startswith(f"configs/tiny.toml: {named}") and "\n" not in message
    assert message.endswith("this machine has 23 GB available")


def test_train_refuses_a_model_that_cannot_fit_before_it_writes_anything(tmp_path):
    config = tiny_config(text_corpus(tmp_path)).with_overrides(["model.d_model=1000000"])
    out = tmp_path / "runs" / "huge"
    with pytest.raises(InputError, match="model.d_model=1000000"):
        train(config, out, progress=False)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("override", ["model.d_model=1000000", "train.batch_size=1000000000"])
def test_the_cli_refuses_a_run_that_cannot_fit_in_one_line_and_leaves_no_folder(tmp_path, override):
    out = tmp_path / "runs" / "tiny"
    result = CliRunner().invoke(main, ["train", "configs/tiny.toml", "--set", override, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"depthdiag: error: configs/tiny.toml: {override}")
    assert result.output.count("\n") == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("resamples", [RESAMPLES_RANGE[0] - 1, RESAMPLES_RANGE[1] + 1])
def test_resamples_outside_the_range_are_refused(tmp_path, resamples):
    with pytest.raises(InputError, match="n_resamples"):
        IntervalOptions(method="bca", n_resamples=resamples)
    result = CliRunner().invoke(
        main, ["summarize", str(tmp_path / "absent.h5"), "--method", "bca", "--resamples", str(resamples)]
    )
    assert result.exit_code == 2 and "--resamples" in result.output
