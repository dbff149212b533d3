"""The one seeded-generator recipe gives the streams the three recipes it replaced gave."""

import numpy as np
import pytest

from trainer.data import bios
from trainer.rng import batch_rng, seeded_generator
from trainer.schedules import DEPTH_SALT, _generator


@pytest.mark.parametrize("words", [(0, 0), (7, 123), (0, 5, DEPTH_SALT), (3, 1, 0xB105), (2**64 - 3, 11, DEPTH_SALT)])
def test_seeded_generator_draws_what_the_replaced_recipes_drew(words):
    replaced = {
        "PCG64 of the words (training batches, bioS)": np.random.Generator(np.random.PCG64(list(words))),
        "default_rng of the words (depth draws)": np.random.default_rng(list(words)),
    }
    for recipe, generator in replaced.items():
        assert seeded_generator(*words).random(8).tolist() == generator.random(8).tolist(), recipe


def test_seeded_streams_keep_their_numbers():
    """Numbers drawn before the recipes were unified: training runs depend on every one."""
    assert batch_rng(0, 0).integers(0, 2**31, 3).tolist() == [1826701615, 1367864807, 1097657232]
    assert batch_rng(7, 123).integers(0, 2**31, 3).tolist() == [838770363, 278751060, 1806100798]
    assert _generator(0, 5).integers(0, 2**31, 3).tolist() == [592886725, 1225655207, 1301538372]
    assert _generator(-3, 11).integers(0, 2**31, 3).tolist() == [1965157959, 1532886833, 1672323686]
    population = seeded_generator(3, bios._POPULATION_STREAM, bios._BIOS_SALT)
    assert population.integers(0, 2**31, 3).tolist() == [1916547470, 549963238, 1054949447]
    evaluation = seeded_generator(3, bios._EVAL_STREAM, bios._BIOS_SALT)
    assert evaluation.integers(0, 2**31, 3).tolist() == [1294586186, 2017845296, 1358081569]
