"""trainer/config.py: loading, overrides and validation of run configs."""

import pytest

from common.errors import InputError
from trainer.config import RunConfig, load_config


def test_tiny_config_round_trips_through_json():
    config = load_config("configs/tiny.toml")
    assert RunConfig.from_json(config.to_json()) == config


def test_overrides_parse_toml_literals():
    config = load_config(
        "configs/tiny.toml",
        ["train.updates=12", "train.schedule=fixed:4", "train.snapshot_uniform_updates=[0, 4]", "model.d_model=64"],
    )
    assert config.train.updates == 12
    assert config.train.schedule == "fixed:4"
    assert config.train.snapshot_uniform_updates == (0, 4)
    assert config.model.d_model == 64


@pytest.mark.parametrize(
    "text, message",
    [
        ("[model]\nwidth = 3\n", "unknown key"),
        ("[trainer]\nupdates = 3\n", "unknown config section"),
        ("[model]\nd_model = 30\nn_heads = 4\n", "divide"),
        ("[train]\nseq_len = 999\n", "max_seq_len"),
        ("[model\n", "invalid TOML"),
        ('[train]\nschedule = "fixed:0"\n', "train.schedule: schedule 'fixed:0'"),
        ("[train]\nupdates = 100.5\n", "train.updates must be int"),
        ('[train]\nupdates = "many"\n', "train.updates must be int"),
        ("[model]\nd_model = 128.0\n", "model.d_model must be int"),
        ("[model]\ntie_embeddings = 1\n", "model.tie_embeddings must be bool"),
        ("[train]\nsnapshot_uniform_updates = [0, 1.5]\n", "must be a list of integers"),
        ("[optim]\nlr = nan\n", "optim.lr must be a finite number"),
        ("[optim]\ngrad_clip = inf\n", "optim.grad_clip must be a finite number"),
        ("[model]\ninit_std = -inf\n", "model.init_std must be a finite number"),
    ],
)
def test_bad_config_names_the_file(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InputError, match=message) as err:
        load_config(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(InputError, match="no such config file"):
        load_config(tmp_path / "absent.toml")


@pytest.mark.parametrize(
    "assignment",
    ["updates=3", "train.nope=1", "nosection.x=1", "train.seed=-1", "data.seed=-2", "optim.lr=nan", "optim.beta2=inf"],
)
def test_bad_override(assignment):
    with pytest.raises(InputError):
        load_config("configs/tiny.toml", [assignment])
