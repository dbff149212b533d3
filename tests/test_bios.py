"""trainer/data/bios.py, the bioS task, and its scoring (trainer/scoring.py)."""

import math
import re

import numpy as np
import pytest
import torch

from common.errors import InputError
from trainer.config import load_config
from trainer.data.bios import ATTRIBUTES, SEP, BiosSource, BiosSpec
from trainer.data.sources import TokenSource, build_source
from trainer.model import LoopedTransformer, ModelConfig
from trainer.scoring import exact_values, logits_by_depth, nll_by_depth, recall_bits, score_recall

CITY, EMPLOYER = ATTRIBUTES.index("birth city"), ATTRIBUTES.index("employer")


@pytest.fixture(scope="module")
def source() -> BiosSource:
    return BiosSource.generate(people=60, seed=3)


def test_configured_cardinalities_carry_the_papers_bits_per_person():
    spec = BiosSpec()
    bits = sum(math.log2(c) for c in spec.cardinalities)
    assert bits == pytest.approx(33.39, abs=0.005)
    assert spec.bits_per_person == pytest.approx(bits)


def test_tiny_config_vocabulary_fits_the_model():
    config = load_config("configs/tiny.toml")
    source = build_source(config.data)
    assert isinstance(source, TokenSource)
    assert source.people == config.data.bios_people
    assert source.vocab_size <= config.model.vocab_size
    tokens = torch.cat([source.batch(0, 0, 32, 64), source.eval_tokens(8, 64)])
    assert int(tokens.min()) >= 0 and int(tokens.max()) < source.vocab_size


def expected_bio(source: BiosSource, person: int, template: int, order) -> list[int]:
    """Independent rendering: SEP, name, then (relation, value) in `order`."""
    tokens = [SEP, *source.names[person]]
    for attribute in order:
        spelling = source.value_spellings[attribute][source.values[person, attribute]]
        tokens += [source.spec.relation_token(template, attribute), *spelling]
    return [int(t) for t in tokens]


def test_sequences_follow_the_appendix_tables(source):
    spec = source.spec
    person = 7
    for template in range(spec.templates):
        assert source.training_sequence(person, template).tolist() == expected_bio(
            source, person, template, spec.training_orders[template]
        )
        assert source.evaluation_sequence(person, template).tolist() == expected_bio(
            source, person, template, spec.evaluation_orders[template]
        )

    # Table 1: training presents the employer before the birth city, evaluation the birth
    # city first; names and the birth city's value are several tokens.
    training = source.describe(source.training_sequence(person, 0))
    evaluation = source.describe(source.evaluation_sequence(person, 0))
    name = r"\[SEP\] N\d+ N\d+ N\d+"
    assert re.match(name + r" \[employer\] V\d+ V\d+ \[birth city\] V\d+ V\d+ ", training)
    assert re.match(name + r" \[birth city\] V\d+ V\d+ \[employer\] V\d+ V\d+ ", evaluation)

    prompt, answer = source.evaluation_prompt(person, CITY, 0)
    city = source.value_spellings[CITY][source.values[person, CITY]]
    assert answer.tolist() == city.tolist() and len(answer) >= 2
    assert prompt.tolist() == [SEP, *source.names[person].tolist(), spec.relation_token(0, CITY)]
    # the same fact sits elsewhere in the training sequence, followed by the same answer
    training_tokens = source.training_sequence(person, 0).tolist()
    at = training_tokens.index(spec.relation_token(0, CITY))
    assert training_tokens[at + 1 : at + 1 + len(answer)] == answer.tolist()
    assert training_tokens[: len(prompt)] != prompt.tolist()


def test_templates_differ_in_order_and_wording():
    spec = BiosSpec()
    orders = spec.training_orders + spec.evaluation_orders
    assert len(set(orders)) == 2 * spec.templates == 10
    relations = {spec.relation_token(t, a) for t in range(spec.templates) for a in range(len(ATTRIBUTES))}
    assert len(relations) == spec.templates * len(ATTRIBUTES)
    with pytest.raises(ValueError, match="differ"):
        BiosSpec(evaluation_orders=(spec.training_orders[0],) + spec.evaluation_orders[1:])
    with pytest.raises(ValueError, match="do not fit"):
        BiosSpec(value_vocab=16)


def test_population_is_pure_in_the_seed_and_well_formed(source):
    again = BiosSource.generate(people=60, seed=3)
    other = BiosSource.generate(people=60, seed=4)
    assert np.array_equal(source.facts, again.facts)
    assert not np.array_equal(source.facts, other.facts)
    assert len({tuple(n) for n in source.names}) == source.people
    assert source.names.shape[1] == 3
    for attribute, cardinality in enumerate(source.spec.cardinalities):
        spellings = source.value_spellings[attribute]
        assert len({tuple(s) for s in spellings}) == cardinality
        assert 0 <= source.values[:, attribute].min() and source.values[:, attribute].max() < cardinality


def split_bios(row: list[int]) -> list[list[int]]:
    bios, current = [], []
    for token in row:
        if token == SEP and current:
            bios.append(current)
            current = []
        current.append(token)
    return bios + [current]


def fact_order(source: BiosSource, bio: list[int]) -> tuple[tuple[int, ...], set[int]]:
    """(attribute order, set of wordings) from the relation tokens of a complete bio."""
    relations = [t - 1 for t in bio if SEP < t < source.spec.first_name_token]
    return tuple(r % len(ATTRIBUTES) for r in relations), {r // len(ATTRIBUTES) for r in relations}


def test_batches_and_eval_tokens_pack_training_bios(source):
    spec = source.spec
    for tokens, orders in (
        (source.batch(5, 2, 8, 64), spec.training_orders),
        (source.eval_tokens(8, 64), spec.training_orders),
    ):
        assert tokens.shape == (8, 65) and tokens.dtype == torch.int64
        for row in tokens.tolist():
            assert row[0] == SEP
            complete = [bio for bio in split_bios(row) if len(bio) == spec.bio_length]
            assert len(complete) == 65 // spec.bio_length
            for bio in complete:
                order, wordings = fact_order(source, bio)
                (wording,) = wordings
                assert order == orders[wording]
    assert torch.equal(source.eval_tokens(8, 64), BiosSource.generate(people=60, seed=3).eval_tokens(8, 64))
    # Its own packing: no evaluation row is a training batch's row.
    training_rows = {tuple(row) for step in range(50) for row in source.batch(0, step, 32, 64).tolist()}
    assert not training_rows & {tuple(row) for row in source.eval_tokens(64, 64).tolist()}


def test_score_recall_matches_a_loop_reference():
    rng = np.random.default_rng(0)
    cardinalities = (200, 28, 12, 100, 25, 67)
    correct = rng.random((40, 6, 5)) < 0.8
    reference = 0.0
    for person in range(40):
        for attribute in range(6):
            if sum(correct[person, attribute]) >= 4:
                reference += math.log2(cardinalities[attribute])
    assert score_recall(correct, cardinalities) == pytest.approx(reference / 40)
    assert score_recall(np.ones((3, 6, 5), bool), cardinalities) == pytest.approx(33.39, abs=0.005)
    four_of_five = np.ones((3, 6, 5), bool)
    four_of_five[..., 0] = False
    assert score_recall(four_of_five, cardinalities) == pytest.approx(score_recall(np.ones((3, 6, 5)), cardinalities))
    four_of_five[..., 1] = False
    assert score_recall(four_of_five, cardinalities) == 0.0


class AnswerKeyModel(torch.nn.Module):
    """Predicts each next token as given, except value tokens, which it reads from an
    answer key chosen by depth; `wrong` lists (attribute, wording) pairs it always misses."""

    def __init__(self, source: BiosSource, keys: dict[int, np.ndarray], wrong=()):
        super().__init__()
        self.source, self.keys, self.wrong = source, keys, set(wrong)
        self.person_of = {tuple(name): p for p, name in enumerate(source.names.tolist())}

    def forward(self, input_ids: torch.Tensor, depth: int) -> torch.Tensor:
        spec, key = self.source.spec, self.keys[depth]
        predicted = input_ids.roll(-1, dims=1).clone()  # [B, T]
        for row, tokens in enumerate(input_ids.tolist()):
            person = self.person_of[tuple(tokens[1 : 1 + spec.name_length])]
            for i, token in enumerate(tokens):
                if SEP < token < spec.first_name_token:
                    wording, attribute = divmod(token - 1, len(ATTRIBUTES))
                    value = key[person, attribute] + ((attribute, wording) in self.wrong)
                    spellings = self.source.value_spellings[attribute]
                    spelling = spellings[value % len(spellings)]
                    predicted[row, i : i + len(spelling)] = torch.as_tensor(spelling)
        return torch.nn.functional.one_hot(predicted, self.source.vocab_size).float()  # [B, T, V]


def test_recall_is_full_on_the_true_key_and_zero_on_a_shuffled_key(source):
    cardinalities = np.array(source.spec.cardinalities)
    offsets = np.random.default_rng(1).integers(1, cardinalities, size=(source.people, len(ATTRIBUTES)))
    shuffled = (source.values + offsets) % cardinalities  # every person's every value wrong
    model = AnswerKeyModel(source, {1: shuffled, 2: source.values})
    bits = recall_bits(model, source, [2, 1], batch_size=64)
    assert set(bits) == {1, 2}
    assert bits[2] == pytest.approx(source.spec.bits_per_person)
    assert bits[1] == 0.0


def test_recall_needs_four_of_five_templates(source):
    # birth city missed on one wording (still recalled), employer on two (lost)
    model = AnswerKeyModel(source, {3: source.values}, wrong=[(CITY, 0), (EMPLOYER, 0), (EMPLOYER, 3)])
    bits = recall_bits(model, source, [3])
    assert bits[3] == pytest.approx(source.spec.bits_per_person - math.log2(source.spec.cardinalities[EMPLOYER]))


class SeparateForwards(torch.nn.Module):
    """Hides the looped model's one-pass readout so recall falls back to one forward per depth."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, depth):
        return self.model(input_ids, depth=depth)


def test_one_pass_recall_agrees_with_separate_forwards():
    source = BiosSource.generate(people=12, seed=0)
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=source.vocab_size, max_seq_len=32, d_model=32, n_heads=2))
    # At initialisation the adapter ignores the state, so every depth would give the same
    # logits and a mix-up of depths would go unnoticed; perturbed weights make them differ.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = source.recall_set()[0][:16]
    depths = [1, 3, 4]
    assert not torch.allclose(model(ids, depth=1), model(ids, depth=4))
    for depth, logits in logits_by_depth(model, ids, depths):
        torch.testing.assert_close(logits, model(ids, depth=depth))
    model.train()
    bits = recall_bits(model, source, depths)
    assert model.training
    assert bits == recall_bits(SeparateForwards(model), source, depths)
    assert all(0 <= b <= source.spec.bits_per_person for b in bits.values())


def test_attribute_eval_counts_exactly_the_attribute_values_of_evaluation_bios(source):
    spec = source.spec
    tokens, mask = source.attribute_eval(6, 64)
    assert tokens.shape == (6, 65) and mask.shape == (6, 64) and mask.dtype == torch.bool
    # The same people and packing as eval_tokens, in the evaluation orders.
    names = slice(1, 1 + spec.name_length)  # the first bio's name: same person in both sets
    assert torch.equal(tokens[:, names], source.eval_tokens(6, 64)[:, names])
    for row in tokens.tolist():
        for bio in split_bios(row):
            if len(bio) == spec.bio_length:
                order, (wording,) = fact_order(source, bio)
                assert order == spec.evaluation_orders[wording]
    # Each complete bio against its hand-built version, [SEP] name (relation value) x 6 in the
    # evaluation order of its wording: the counted targets are exactly its value tokens.
    people = {tuple(name): person for person, name in enumerate(source.names.tolist())}
    checked = 0
    for r, row in enumerate(tokens.tolist()):
        start = 0
        for bio in split_bios(row):
            if len(bio) == spec.bio_length:
                person = people[tuple(bio[names])]
                _, (template,) = fact_order(source, bio)
                expected = expected_bio(source, person, template, spec.evaluation_orders[template])
                assert bio == expected
                values = {start + i for i, t in enumerate(expected) if t >= spec.first_value_token}
                assert len(values) == sum(spec.value_lengths)
                counted = {t + 1 for t in range(64) if mask[r, t] and start <= t + 1 < start + spec.bio_length}
                assert counted == values - {0}
                checked += 1
            start += len(bio)
    assert checked >= 6 * (65 // spec.bio_length)
    assert torch.equal(mask, tokens[:, 1:] >= spec.first_value_token)


def test_score_recall_reads_flags_as_truth_values_and_bits_in_float64():
    cardinalities = (200, 28, 12, 100, 25, 67)
    # Flags as a 0/255 byte mask: one exact template of five is one, not 255 of them.
    one_template = np.zeros((2, 6, 5), dtype=np.uint8)
    one_template[..., 0] = 255
    assert score_recall(one_template, cardinalities) == 0.0
    four_templates = np.zeros((2, 6, 5), dtype=np.uint8)
    four_templates[0, :, :4] = 255
    bits = sum(math.log2(c) for c in cardinalities)
    assert score_recall(four_templates, cardinalities) == pytest.approx(bits / 2, rel=1e-12)
    # Cardinalities in a narrow integer type: still float64 bits (float32 would be off by ~1e-7).
    narrow = np.asarray(cardinalities, dtype=np.int16)
    assert score_recall(np.ones((1, 6, 5), bool), narrow) == pytest.approx(bits, rel=1e-12)


@pytest.mark.parametrize("shape", [(3, 6), (3, 5, 5), (3, 6, 5, 1)])
def test_score_recall_refuses_flags_of_another_shape(shape):
    with pytest.raises(InputError, match=r"correct must be \[people, 6, templates\]"):
        score_recall(np.ones(shape, bool), (200, 28, 12, 100, 25, 67))


def test_exact_values_stay_on_the_tokens_device():
    """The meta device (shapes only) stands in for an accelerator: no CPU tensor may enter."""
    logits = torch.empty(2, 5, 9, device="meta")
    tokens = torch.zeros(2, 5, dtype=torch.long, device="meta")
    exact = exact_values(logits, tokens, tokens, 3)
    assert exact.device.type == "meta" and exact.shape == (2, 3) and exact.dtype == torch.bool


def test_scoring_a_looped_model_reads_every_depth_from_one_pass():
    """max(depths) core iterations in all, not one forward per depth (1 + 3 + 4 = 8)."""
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=40, max_seq_len=8, d_model=16, n_heads=2, n_core=1))
    iterations = []
    model.core[0].register_forward_hook(lambda module, args, out: iterations.append(1))
    with torch.no_grad():
        depths = [depth for depth, _ in logits_by_depth(model, torch.zeros(2, 8, dtype=torch.long), [4, 1, 3])]
    assert depths == [1, 3, 4] and len(iterations) == 4


def test_nll_of_a_model_without_a_one_pass_readout_is_the_looped_models_own():
    """One forward per depth (the fallback), with ignored targets and with substituted weights."""
    torch.manual_seed(0)
    model = LoopedTransformer(ModelConfig(vocab_size=40, max_seq_len=8, d_model=16, n_heads=2))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x, y = torch.randint(0, 40, (3, 8)), torch.randint(0, 40, (3, 8))
    y[0, :5] = -1
    depths = [3, 1]
    with torch.no_grad():
        expected = model.nll_by_depth(x, y, depths)
        torch.testing.assert_close(nll_by_depth(SeparateForwards(model), x, y, depths), expected, rtol=1e-6, atol=1e-6)
        other = {name: t + 0.1 for name, t in model.state_dict().items()}
        moved = LoopedTransformer(model.config)
        moved.load_state_dict(other)
        routed = {f"model.{name}": t for name, t in other.items()}
        got = nll_by_depth(SeparateForwards(model), x, y, depths, state=lambda: routed)
        torch.testing.assert_close(got, moved.nll_by_depth(x, y, depths), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(nll_by_depth(model, x, y, depths, state=lambda: other), got, rtol=1e-6, atol=1e-6)
    assert (got - expected).abs().min() > 1e-3


# --- planted hop sequences ----------------------------------------------------------------------


def _follow(sequence: list[int], source: BiosSource, query: int = 0) -> int:
    """A planted sequence's answer to one of its queries worked out from its own listed pairs: h
    lookups from the start."""
    asked = 3 * source.planted_queries
    pairs = sequence[-2 * source.planted_pairs - asked : -asked]
    successor = dict(zip(pairs[0::2], pairs[1::2]))
    hops_token, at = sequence[len(sequence) - asked + 3 * query : len(sequence) - asked + 3 * query + 2]
    for _ in range(hops_token - source.chain_token):
        at = successor[at]
    return at


def test_planted_sequences_are_hop_lookups_at_the_configured_share():
    planted = BiosSource.generate(500, 0, planted_fraction=0.2)
    plain = BiosSource.generate(500, 0)
    length = planted.spec.bio_length
    batch = planted.batch(0, 3, 256, 4 * length - 1)  # four whole slots per row
    slots = batch.reshape(-1, length).numpy()
    is_planted = slots[:, 1] == planted.chain_token
    assert abs(is_planted.mean() - 0.2) < 0.03
    for sequence in slots[is_planted].tolist():
        assert sequence[0] == SEP and sequence[-1] == _follow(sequence, planted)
        listed = sequence[-2 * planted.planted_pairs - 3 : -3]
        assert sorted(listed[0::2]) == sorted(listed[1::2])  # a permutation of distinct values
        assert len(set(listed[0::2])) == planted.planted_pairs
    # The other slots are the bios an unplanted stream has there.
    unplanted = plain.batch(0, 3, 256, 4 * length - 1).reshape(-1, length).numpy()
    np.testing.assert_array_equal(slots[~is_planted], unplanted[~is_planted])
    hops = slots[is_planted][:, -3] - planted.chain_token
    assert set(hops.tolist()) == {1, 2, 3, 4}
    answers = planted.planted_answers(batch.numpy())
    assert answers.sum() == is_planted.sum() and (batch.numpy()[answers] >= planted.spec.first_value_token).all()


def test_planted_rows_ask_several_queries_of_every_slot_of_a_planted_row():
    planted = BiosSource.generate(
        500, 0, planted_fraction=0.5, planted_unit="row", planted_queries=3, planted_max_hops=8
    )
    plain = BiosSource.generate(500, 0)
    length = planted.spec.bio_length
    assert planted.planted_pairs == (length - 11) // 2 and planted.vocab_size == plain.vocab_size + 9
    batch = planted.batch(0, 3, 256, 4 * length - 1).numpy()
    slots = batch.reshape(256, 4, length)
    is_planted = slots[:, :, 1] == planted.chain_token
    assert (is_planted == is_planted[:, :1]).all() and abs(is_planted[:, 0].mean() - 0.5) < 0.08
    hops = set()
    for sequence in slots[is_planted].tolist():
        assert sequence[0] == SEP and sequence[1] == planted.chain_token
        listed = sequence[2 : 2 + 2 * planted.planted_pairs]
        assert sorted(listed[0::2]) == sorted(listed[1::2]) and len(set(listed[0::2])) == planted.planted_pairs
        for query in range(3):
            assert sequence[length - 9 + 3 * query + 2] == _follow(sequence, planted, query)
            hops.add(sequence[length - 9 + 3 * query] - planted.chain_token)
    assert hops == set(range(1, 9))
    np.testing.assert_array_equal(
        slots[~is_planted], plain.batch(0, 3, 256, 4 * length - 1).numpy().reshape(256, 4, length)[~is_planted]
    )
    answers = planted.planted_answers(batch)
    assert answers.sum() == 3 * is_planted.sum()
    tokens, owners = planted.attribute_owners(64, 64)
    assert torch.equal(owners == len(ATTRIBUTES), torch.from_numpy(planted.planted_answers(tokens.numpy())))
    with pytest.raises(InputError, match="need a bio of 27"):
        BiosSource.generate(500, 0, planted_fraction=0.5, planted_queries=7)
    for key, value in (("planted_unit", "'person'"), ("planted_queries", "0"), ("planted_max_hops", "0")):
        with pytest.raises(InputError, match=key):
            load_config("configs/tiny.toml").with_overrides([f"data.{key}={value}"])


def test_planted_answers_are_the_planted_group_of_the_evaluation_set():
    source = BiosSource.generate(500, 0, planted_fraction=0.2)
    tokens, owners = source.attribute_owners(64, 64)
    answers = torch.from_numpy(source.planted_answers(tokens.numpy()))
    assert answers.any() and torch.equal(owners == len(ATTRIBUTES), answers)
    assert source.owner_labels == (*ATTRIBUTES, "planted") and source.vocab_size == 200
    assert source.describe([source.chain_token, source.chain_token + 3]) == "[chain] [hops 3]"
    with pytest.raises(InputError, match="planted_fraction"):
        load_config("configs/tiny.toml").with_overrides(["data.planted_fraction=1.0"])
    assert not {key for key in load_config("configs/tiny.toml").to_dict()["data"] if key.startswith("planted")}
    assert load_config("configs/tiny-planted-rows.toml").to_dict()["data"]["planted_unit"] == "row"
