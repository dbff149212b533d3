"""common/observers.py: the config keys that observe a run without changing it."""

from common.observers import OBSERVER_KEYS, without_observer_keys
from trainer.config import RunConfig


def test_observer_keys_exist_in_the_run_config():
    sections = RunConfig().all_sections()
    for section, keys in OBSERVER_KEYS.items():
        assert set(keys) <= set(sections[section]), section


def test_without_observer_keys_drops_them_and_the_sections_they_empty():
    config = {
        "train": {"seed": 1, "log_every": 5, "eval_every": 10, "eval_depths": "1-4"},
        "logging": {"tensorboard": True, "wandb": False, "wandb_project": "p"},
        "optim": {"lr": 0.1},
    }
    assert without_observer_keys(config) == {"train": {"seed": 1}, "optim": {"lr": 0.1}}
    assert without_observer_keys("not a config") == "not a config"
