"""The bioS synthetic factual-recall task (after Allen-Zhu and Li, 2023), generated
in-process from a seed.

Fictional people have six attributes (birth city, birth day, birth month,
university, major, employer) drawn uniformly and independently, so a person
carries sum(log2(cardinality)) bits: 33.39 with the default cardinalities.
Names are several tokens (N17 N204 N6), values one to three (V3 V11); value
spellings are distinct within an attribute and share one value vocabulary
across attributes, so only the relation token says which attribute a value
belongs to.

A bio is `[SEP] name ([relation] value) x 6`. Template t fixes the order of
the six facts and the wording of the relation tokens (template t's relation
tokens are its own). Training bios use the training orders; evaluation uses
the same people and wordings with the facts in other orders, so recall cannot
come from memorised sequences (the paper's appendix tables 1-2). The evaluation
NLL (`eval_tokens`) is over training-template bios, see there.

    training    [SEP] N17 N204 N6 [employer] V6 V10 [birth city] V3 V11 ...
    evaluation  [SEP] N17 N204 N6 [birth city] ___ ___ [employer] V6 V10 ...
    answer      V3 V11

Recall: a fact counts when its whole value is produced exactly on at least 4
of the 5 evaluation templates; recalled bits per person is the sum of
log2(cardinality) over recalled facts, averaged over people. With teacher
forcing, one pass over the full evaluation bio scores all six facts at once:
a value is produced exactly by greedy decoding iff the argmax is right at
every one of its tokens given the right earlier tokens. This module generates the
data; trainer/scoring.py scores a model on it (`recall_bits`).

Planted sequences (`data.planted_fraction`, docs/data.md): a known share of the bio slots
(or of the rows, every slot of a planted row) holds an in-context multi-hop lookup instead, as
long as a bio, that each loop iteration can advance by one hop:

    [SEP] [chain] V7 V30 V30 V2 V2 V51 ... [hops 3] V7 V51     (V7 -> V30 -> V2 -> V51)

P pairs (x, f(x)) of a random permutation f of P distinct value tokens, then Q queries (1 by
default), each the number of hops h (1..max_hops), a start x and the answer f^h(x): the
answers are the only targets a planted sequence adds to the counted evaluation targets (as the
group `planted` of the attribute grouping).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.choices import PLANTED_UNIT_CHOICES
from common.errors import InputError
from trainer.rng import batch_rng, rank_rows, seeded_generator

ATTRIBUTES = ("birth city", "birth day", "birth month", "university", "major", "employer")

SEP = 0
"""Starts every bio; rows of a batch pack several bios back to back."""

PLANTED = "planted"
"""The attribute label of a planted sequence's answer (owner index len(ATTRIBUTES))."""

_POPULATION_STREAM, _EVAL_STREAM = 0, 1
"""Generator streams of the population and of the evaluation set."""
_BIOS_SALT = 0xB105
"""Third seed word of the bioS streams, so they never coincide with a training
batch's generator, which is seeded by (train.seed, step) alone."""


@dataclass(frozen=True)
class BiosSpec:
    cardinalities: tuple[int, ...] = (200, 28, 12, 100, 25, 67)
    """Possible values per attribute, in ATTRIBUTES order; log2 of their product is
    33.39 bits per person, the paper's figure."""
    value_lengths: tuple[int, ...] = (2, 1, 1, 3, 2, 2)
    """Tokens per value, per attribute."""
    name_length: int = 3
    """Tokens per name."""
    name_vocab: int = 100
    """Distinct name tokens; names are distinct tuples of them."""
    value_vocab: int = 64
    """Distinct value tokens, shared by all attributes."""
    training_orders: tuple[tuple[int, ...], ...] = (
        (5, 0, 1, 2, 3, 4),
        (1, 2, 0, 3, 4, 5),
        (3, 4, 5, 0, 1, 2),
        (0, 3, 4, 5, 2, 1),
        (4, 5, 3, 1, 2, 0),
    )
    """Fact order (attribute indices) of each training template."""
    evaluation_orders: tuple[tuple[int, ...], ...] = (
        (0, 5, 1, 2, 3, 4),
        (2, 1, 4, 3, 5, 0),
        (5, 3, 0, 2, 4, 1),
        (1, 0, 2, 4, 5, 3),
        (3, 2, 5, 1, 0, 4),
    )
    """Fact order of each evaluation template; template t keeps training template t's
    wording, and no evaluation order is a training order."""
    recall_min_templates: int = 4
    """A fact is recalled when answered exactly on at least this many evaluation templates."""

    def __post_init__(self) -> None:
        for name in ("cardinalities", "value_lengths", "training_orders", "evaluation_orders"):
            object.__setattr__(
                self, name, tuple(tuple(v) if isinstance(v, (list, tuple)) else v for v in getattr(self, name))
            )
        n = len(ATTRIBUTES)
        if len(self.cardinalities) != n or len(self.value_lengths) != n:
            raise InputError(f"bioS needs {n} cardinalities and value lengths, one per attribute")
        if min(self.cardinalities) < 2 or min(self.value_lengths) < 1:
            raise InputError("bioS cardinalities must be >= 2 and value lengths >= 1")
        for attribute, cardinality, length in zip(ATTRIBUTES, self.cardinalities, self.value_lengths):
            if self.value_vocab**length < cardinality:
                raise InputError(
                    f"bioS {attribute}: {cardinality} values do not fit in {length} token(s) "
                    f"of a {self.value_vocab}-token value vocabulary"
                )
        if self.name_length < 1 or self.name_vocab < 1:
            raise InputError("bioS name_length and name_vocab must be >= 1")
        if len(self.training_orders) != len(self.evaluation_orders) or not self.training_orders:
            raise InputError("bioS needs as many evaluation orders as training orders (one per template)")
        for order in self.training_orders + self.evaluation_orders:
            if sorted(order) != list(range(n)):
                raise InputError(f"bioS template order {order} is not a permutation of 0..{n - 1}")
        if set(self.training_orders) & set(self.evaluation_orders):
            raise InputError("bioS evaluation orders must differ from every training order")
        if not 1 <= self.recall_min_templates <= self.templates:
            raise InputError(f"bioS recall_min_templates must be in [1, {self.templates}]")

    @property
    def templates(self) -> int:
        return len(self.training_orders)

    @property
    def bits_per_person(self) -> float:
        return float(sum(math.log2(c) for c in self.cardinalities))

    @property
    def bio_length(self) -> int:
        """Tokens of one bio, SEP included (the same for every template)."""
        return 1 + self.name_length + len(ATTRIBUTES) + sum(self.value_lengths)

    # Token layout: SEP, relation tokens (template-major), name tokens, value tokens.
    def relation_token(self, template: int, attribute: int) -> int:
        return 1 + template * len(ATTRIBUTES) + attribute

    @property
    def first_name_token(self) -> int:
        return 1 + self.templates * len(ATTRIBUTES)

    @property
    def first_value_token(self) -> int:
        return self.first_name_token + self.name_vocab

    @property
    def vocab_size(self) -> int:
        return self.first_value_token + self.value_vocab

    def token_text(self, token: int) -> str:
        """Readable form of a token: [SEP], [employer], [employer#2] (template 2's wording), N17, V3."""
        if token == SEP:
            return "[SEP]"
        if token < self.first_name_token:
            template, attribute = divmod(token - 1, len(ATTRIBUTES))
            return f"[{ATTRIBUTES[attribute]}{f'#{template}' if template else ''}]"
        if token < self.first_value_token:
            return f"N{token - self.first_name_token}"
        if token < self.vocab_size:
            return f"V{token - self.first_value_token}"
        raise InputError(f"token {token} is outside the bioS vocabulary of {self.vocab_size}")

    def layout(self, template: int, order: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """How to render a bio from a person's fact row (name tokens, then each
        attribute's value tokens in ATTRIBUTES order): (source, owner), both int64
        [bio_length]. source[i] >= 0 takes fact-row column source[i]; source[i] < 0
        is the constant token -source[i] - 1. owner[i] is the attribute whose value
        token sits at position i, or -1."""
        value_start = np.cumsum((self.name_length,) + self.value_lengths)[:-1]
        source = [-SEP - 1] + list(range(self.name_length))
        owner = [-1] * (1 + self.name_length)
        for attribute in order:
            source.append(-self.relation_token(template, attribute) - 1)
            owner.append(-1)
            length = self.value_lengths[attribute]
            source.extend(range(value_start[attribute], value_start[attribute] + length))
            owner.extend([attribute] * length)
        return np.array(source, dtype=np.int64), np.array(owner, dtype=np.int64)


class BiosSource:
    """A bioS population and its token streams; a TokenSource (trainer/data/sources.py)."""

    def __init__(
        self,
        spec: BiosSpec,
        names: np.ndarray,
        values: np.ndarray,
        value_spellings: tuple[np.ndarray, ...],
        seed: int,
        planted_fraction: float = 0.0,
        *,
        planted_unit: str = "slot",
        planted_queries: int = 1,
        planted_max_hops: int = 4,
    ):
        self.spec = spec
        self.names = names
        """int64 [people, name_length]: each person's name tokens (distinct rows)."""
        self.values = values
        """int64 [people, attributes]: each person's value index per attribute."""
        self.value_spellings = value_spellings
        """Per attribute, int64 [cardinality, value_length]: the tokens of each value (distinct rows)."""
        self.seed = seed
        self.planted_fraction = planted_fraction
        """The share of bio slots (or rows, see planted_unit) that hold planted hop sequences
        instead (0: none)."""
        self.planted_unit = planted_unit
        """'slot': each bio slot is planted with probability planted_fraction; 'row': each row,
        and then every slot of it."""
        self.planted_queries = planted_queries
        """Queries (hops, start, answer) a planted sequence asks about its one listing."""
        self.planted_max_hops = planted_max_hops
        """A query asks for 1..planted_max_hops hops."""
        self.planted_pairs = (spec.bio_length - 2 - 3 * planted_queries) // 2
        """Pairs (x, f(x)) a planted sequence lists: as many as a bio's length holds beside
        [SEP], one [chain] and the queries."""
        if planted_unit not in PLANTED_UNIT_CHOICES or planted_queries < 1 or planted_max_hops < 1:
            raise InputError(
                f"bioS planted sequences: unit must be one of {PLANTED_UNIT_CHOICES}, queries and max hops >= 1; "
                f"got {planted_unit!r}, {planted_queries}, {planted_max_hops}"
            )
        if planted_fraction and not 2 <= self.planted_pairs <= spec.value_vocab:
            raise InputError(
                f"bioS planted sequences of {planted_queries} queries need a bio of {3 * planted_queries + 6} "
                f"to {2 * spec.value_vocab + 3 * planted_queries + 3} tokens, got {spec.bio_length}"
            )
        self.chain_token = spec.vocab_size
        """[chain]: starts a planted sequence; [hops h] is chain_token + h."""
        self.vocab_size = spec.vocab_size + (1 + planted_max_hops if planted_fraction else 0)
        self.facts = np.concatenate(
            [names] + [value_spellings[a][values[:, a]] for a in range(len(ATTRIBUTES))], axis=1
        )  # [people, name_length + sum(value_lengths)]
        self._training = [spec.layout(t, order) for t, order in enumerate(spec.training_orders)]
        self._evaluation = [spec.layout(t, order) for t, order in enumerate(spec.evaluation_orders)]

    @classmethod
    def generate(
        cls, people: int, seed: int, spec: BiosSpec | None = None, planted_fraction: float = 0.0, **planted
    ) -> BiosSource:
        """`people` fictional people, a pure function of (people, seed, spec); with
        `planted_fraction`, that share of the streams' bio slots planted hop sequences, as
        `planted` (planted_unit, planted_queries, planted_max_hops) describes them."""
        spec = spec or BiosSpec()
        if people < 1 or people > spec.name_vocab**spec.name_length:
            raise InputError(
                f"bioS people must be in [1, {spec.name_vocab**spec.name_length}] (distinct names), got {people}"
            )
        rng = seeded_generator(seed, _POPULATION_STREAM, _BIOS_SALT)
        spellings = tuple(
            spec.first_value_token
            + _digits(rng.choice(spec.value_vocab**length, cardinality, replace=False), spec.value_vocab, length)
            for cardinality, length in zip(spec.cardinalities, spec.value_lengths)
        )
        name_codes = rng.choice(spec.name_vocab**spec.name_length, people, replace=False)
        names = spec.first_name_token + _digits(name_codes, spec.name_vocab, spec.name_length)
        values = np.stack([rng.integers(0, c, size=people) for c in spec.cardinalities], axis=1)
        return cls(spec, names, values, spellings, seed, planted_fraction, **planted)

    @property
    def people(self) -> int:
        return len(self.values)

    # --- rendering ----------------------------------------------------------------------------

    def _render(
        self, persons: np.ndarray, templates: np.ndarray, layouts: list[tuple[np.ndarray, np.ndarray]]
    ) -> np.ndarray:
        """int64 [n, bio_length]: bios of persons[i] with layouts[templates[i]]."""
        source = np.stack([layout[0] for layout in layouts])[templates]  # [n, bio_length]
        constant = source < 0
        fact = np.take_along_axis(self.facts[persons], np.where(constant, 0, source), axis=1)
        return np.where(constant, -source - 1, fact)

    def training_sequence(self, person: int, template: int) -> np.ndarray:
        """int64 [bio_length]: one training bio."""
        return self._render(np.array([person]), np.array([template]), self._training)[0]

    def evaluation_sequence(self, person: int, template: int) -> np.ndarray:
        """int64 [bio_length]: one evaluation bio (facts in the evaluation order)."""
        return self._render(np.array([person]), np.array([template]), self._evaluation)[0]

    def evaluation_prompt(self, person: int, attribute: int, template: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt, answer): the evaluation bio up to and including the probed relation
        token, and the value tokens the model must produce."""
        sequence = self.evaluation_sequence(person, template)
        positions = np.flatnonzero(self._evaluation[template][1] == attribute)
        return sequence[: positions[0]], sequence[positions]

    def describe(self, tokens: Sequence[int]) -> str:
        return " ".join(self._token_text(int(t)) for t in tokens)

    def _token_text(self, token: int) -> str:
        if self.chain_token <= token < self.vocab_size:
            return "[chain]" if token == self.chain_token else f"[hops {token - self.chain_token}]"
        return self.spec.token_text(token)

    @property
    def owner_labels(self) -> tuple[str, ...]:
        """What an owner index means: ATTRIBUTES, then `planted` when sequences are planted."""
        return ATTRIBUTES + ((PLANTED,) if self.planted_fraction else ())

    # --- planted sequences --------------------------------------------------------------------

    def _planted(self, rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Planted hop sequences for every slot of `shape`: tokens int64 [*shape, bio_length]
        and owners (len(ATTRIBUTES) at the answers, -1 elsewhere)."""
        pairs, queries, spec = self.planted_pairs, self.planted_queries, self.spec
        values = spec.first_value_token + rng.random((*shape, spec.value_vocab)).argsort(-1)[..., :pairs]
        successor = rng.random((*shape, pairs)).argsort(-1)  # f(x_i) = x_successor[i]
        hops = rng.integers(1, self.planted_max_hops + 1, size=(*shape, queries))
        start = rng.integers(0, pairs, size=(*shape, queries))
        at = start
        for hop in range(self.planted_max_hops):
            at = np.where(hop < hops, np.take_along_axis(successor, at, -1), at)
        listed = np.stack([values, np.take_along_axis(values, successor, -1)], axis=-1).reshape(*shape, 2 * pairs)
        asked = [self.chain_token + hops, np.take_along_axis(values, start, -1), np.take_along_axis(values, at, -1)]
        asked = np.stack(asked, axis=-1).reshape(*shape, 3 * queries)  # ([hops h] x f^h(x)) per query
        chain = np.full((*shape, spec.bio_length - 1 - 2 * pairs - 3 * queries), self.chain_token)
        tokens = np.concatenate([np.full((*shape, 1), SEP), chain, listed, asked], axis=-1)
        owners = np.full(tokens.shape, -1)
        owners[..., spec.bio_length - 3 * queries + 2 :: 3] = len(ATTRIBUTES)
        return tokens, owners

    def planted_answers(self, tokens: np.ndarray) -> np.ndarray:
        """bool, the shape of `tokens`: the positions that hold a planted sequence's answer (the
        token two after a [hops h] token)."""
        tokens = np.asarray(tokens)
        hops = (tokens > self.chain_token) & (tokens < self.vocab_size)
        answers = np.zeros_like(hops)
        answers[..., 2:] = hops[..., :-2]
        return answers

    # --- TokenSource --------------------------------------------------------------------------

    def _packed(
        self,
        rng: np.random.Generator,
        rows: int,
        keep: slice,
        seq_len: int,
        layouts: list[tuple[np.ndarray, np.ndarray]],
        *,
        with_owners: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows of random bios (random person and template) packed back to back, cut to
        seq_len + 1 tokens; draws for all `rows`, renders rows[keep]. Returns the tokens
        and, when asked, aligned with them the attribute each value token belongs to (-1
        elsewhere)."""
        if seq_len < 1:
            raise InputError(f"seq_len must be >= 1, got {seq_len}")
        per_row = -(-(seq_len + 1) // self.spec.bio_length)
        persons = rng.integers(0, self.people, size=(rows, per_row))[keep]
        templates = rng.integers(0, self.spec.templates, size=(rows, per_row))[keep]
        bios = self._render(persons.ravel(), templates.ravel(), layouts)  # [kept * per_row, bio_length]
        owners = np.stack([layout[1] for layout in layouts])[templates.ravel()]  # [kept * per_row, bio_length]
        if self.planted_fraction:  # drawn after the bios, so that the bios stay those of an unplanted stream
            drawn = rng.random((rows, per_row) if self.planted_unit == "slot" else (rows, 1)) < self.planted_fraction
            planted = np.broadcast_to(drawn, (rows, per_row))[keep].ravel()
            hop_tokens, hop_owners = (part[keep].reshape(bios.shape) for part in self._planted(rng, (rows, per_row)))
            bios = np.where(planted[:, None], hop_tokens, bios)
            owners = np.where(planted[:, None], hop_owners, owners)
        cut = slice(0, seq_len + 1)
        tokens = torch.from_numpy(bios.reshape(len(persons), -1)[:, cut])
        if not with_owners:
            return tokens, None
        return tokens, torch.from_numpy(owners.reshape(len(persons), -1)[:, cut])

    def batch(
        self, seed: int, step: int, batch_size: int, seq_len: int, *, rank: int = 0, world_size: int = 1
    ) -> torch.Tensor:
        keep = rank_rows(batch_size, rank, world_size)
        return self._packed(batch_rng(seed, step), batch_size, keep, seq_len, self._training)[0]

    def eval_tokens(self, n: int, seq_len: int) -> torch.Tensor:
        """Packed training-template bios of the same people in a packing of their own, fixed
        by the data seed. The task is memorisation, so the NLL that matters is the NLL of the
        facts as trained; an NLL over evaluation orders would be dominated by the unpredictable
        next relation token, not by the facts (those orders are for recall)."""
        if n < 1:
            raise InputError(f"n must be >= 1, got {n}")
        rng = seeded_generator(self.seed, _EVAL_STREAM, _BIOS_SALT)
        return self._packed(rng, n, slice(None), seq_len, self._training)[0]

    def attribute_eval(self, n: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The paper's bioS evaluation as an NLL: packed bios in the evaluation orders (the
        presentations recall is scored on, never trained on) and a mask that counts only the
        targets that are attribute-value tokens. Returns tokens int64 [n, seq_len + 1] and
        mask bool [n, seq_len] over the targets tokens[:, 1:]; the same people and packing
        stream as `eval_tokens`."""
        if n < 1:
            raise InputError(f"n must be >= 1, got {n}")
        tokens, owners = self.attribute_owners(n, seq_len)
        return tokens, owners[:, 1:] >= 0

    def attribute_owners(self, n: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`attribute_eval`'s tokens int64 [n, seq_len + 1] and, aligned with them, the attribute
        each value token belongs to (an index into ATTRIBUTES; -1 elsewhere)."""
        if n < 1:
            raise InputError(f"n must be >= 1, got {n}")
        rng = seeded_generator(self.seed, _EVAL_STREAM, _BIOS_SALT)
        return self._packed(rng, n, slice(None), seq_len, self._evaluation, with_owners=True)

    # --- recall -------------------------------------------------------------------------------

    def recall_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (person, evaluation template) bio: tokens int64 [people * templates,
        bio_length] (row p * templates + t) and owner int64 [people * templates,
        bio_length] (the attribute each value token belongs to, -1 elsewhere)."""
        templates = self.spec.templates
        persons = np.repeat(np.arange(self.people), templates)
        template_ids = np.tile(np.arange(templates), self.people)
        owners = np.stack([layout[1] for layout in self._evaluation])[template_ids]
        tokens = self._render(persons, template_ids, self._evaluation)
        return torch.from_numpy(tokens), torch.from_numpy(owners)


def _digits(codes: np.ndarray, base: int, length: int) -> np.ndarray:
    """int64 [n, length]: base-`base` digits of codes, most significant first."""
    powers = base ** np.arange(length - 1, -1, -1)
    return (codes[:, None] // powers) % base
