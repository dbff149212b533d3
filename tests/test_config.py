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


@pytest.mark.parametrize(
    "text, key, value",
    [
        ("[train]\nbatch_size = 100000000000000000000000\n", "train.batch_size", "100000000000000000000000"),
        ("[train]\nseed = -9223372036854775809\n", "train.seed", "-9223372036854775809"),
        (
            "[train]\nsnapshot_uniform_updates = [0, 18446744073709551616]\n",
            "train.snapshot_uniform_updates",
            "18446744073709551616",
        ),
    ],
)
def test_integers_beyond_64_bits_are_refused(tmp_path, text, key, value):
    path = tmp_path / "huge.toml"
    path.write_text(text)
    with pytest.raises(InputError, match="64-bit") as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and key in message and value in message and "\n" not in message


def test_integers_beyond_64_bits_are_refused_through_set():
    with pytest.raises(InputError, match="64-bit") as err:
        load_config("configs/tiny.toml", ["model.d_model=100000000000000000000000"])
    assert str(err.value).startswith("--set 'model.d_model=100000000000000000000000': model.d_model")


def test_the_largest_64_bit_integer_is_accepted():
    assert load_config("configs/tiny.toml", ["train.updates=9223372036854775807"]).train.updates == 2**63 - 1


@pytest.mark.parametrize(
    "text, overrides",
    [
        ('[data]\nsource = "bin"\n', ["data.path='shards'"]),  # data.path is required for 'bin'
        ("[model]\nd_model = 30\nn_heads = 4\n", ["model.d_model=32"]),
        ("[train]\nseq_len = 999\n", ["model.max_seq_len=1024"]),
        ("[train]\nupdates = 100.5\n", ["train.updates=100"]),
    ],
)
def test_overrides_can_make_a_file_valid(tmp_path, text, overrides):
    path = tmp_path / "partial.toml"
    path.write_text(text)
    load_config(path, overrides)


def test_a_relative_data_path_follows_whoever_gave_it(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "bin.toml"
    path.write_text('[data]\nsource = "bin"\npath = "shards"\n')
    monkeypatch.chdir(tmp_path)
    assert load_config(path).data.path == str(tmp_path / "configs" / "shards")
    assert load_config(path, ["data.path='elsewhere'"]).data.path == str(tmp_path / "elsewhere")
    assert load_config(path, ["train.updates=10"]).data.path == str(tmp_path / "configs" / "shards")


@pytest.mark.parametrize(
    "text, overrides, blamed",
    [
        ("[train]\nupdates = 10\n", ["train.seed=-1"], "--set 'train.seed=-1'"),
        ("[train]\nseed = -1\n", ["train.updates=10"], "FILE"),
        ("[model]\nmax_seq_len = 32\n", ["train.seq_len=64"], "FILE, --set 'train.seq_len=64'"),  # both keys named
        ("[train]\nseq_len = 999\n", ["model.d_model=64"], "FILE"),
        ("[train]\nupdates = 10\n", ["data.source='bin'"], "--set \"data.source='bin'\""),
        ("[train]\nupdates = 10\n", ["train.updates='ten'"], "--set \"train.updates='ten'\""),
        ("[train]\nupdates = 10\n", ["train.updates=-1", "train.updates=5", "train.seed=-3"], "--set 'train.seed=-3'"),
        # The message names only model.state_noise_std, which nobody gave: everyone is named.
        ("[train]\nupdates = 10\n", ["model.init_std=-1.0"], "FILE, --set 'model.init_std=-1.0'"),
    ],
)
def test_an_invalid_merged_config_names_who_gave_the_bad_value(tmp_path, text, overrides, blamed):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(InputError) as err:
        load_config(path, overrides)
    message = str(err.value)
    assert message.startswith(blamed.replace("FILE", str(path)) + ": ") and "\n" not in message
