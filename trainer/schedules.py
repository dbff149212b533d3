"""Depth schedules: which recurrent depth K each training update uses.

Spec strings (the CLI and `train.schedule` use them):

    fixed:4                                        K = 4 always
    uniform:1-16                                   K uniform in {1..16} (`uniform` alone: 1-16)
    pln:mean=8,sigma=0.5,max=16                    Poisson-lognormal (Geiping et al. 2025)
    progressive:mean=8,sigma=0.5,max=16,warmup=0.75,shape=1-sqrt
                                                   McLeish et al. 2025 curriculum (shape: 1-sqrt or linear)
    fixed-first:k0=4,switch=0.8,finish=uniform:1-16
                                                   K0 before round(switch * total_updates), then `finish`

Omitted keys take the defaults shown. `finish` must come last in a fixed-first
spec because its value is itself a spec with commas (uniform or pln).

Poisson-lognormal: tau ~ N(log(mean) - sigma^2/2, sigma), K = Poisson(e^tau) + 1,
clipped to max. E[e^tau] = mean, so without clipping E[K] = mean + 1 (as in Huginn).

Progressive: with t = step / total_updates and u = min(t / warmup, 1), the PLN
`mean` parameter at that step is

    linear:  mean_t = 1 + (mean - 1) * u
    1-sqrt:  mean_t = 1 + (mean - 1) * (1 - sqrt(1 - u))

so it rises from 1 at step 0 to `mean` at the end of the warmup fraction and stays
there (1-sqrt rises slowly at first and steeply near the end of the warmup).

Every schedule's `depth_at(step)` is a pure function of (seed, step, total_updates):
its randomness comes from a generator seeded with (seed, step, a fixed salt)
(trainer/rng.py), so a resumed run and every distributed rank agree without
communication, whatever the order of calls. Steps at or beyond total_updates continue the final phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from common.errors import InputError
from trainer.rng import seeded_generator

DEPTH_SALT = 0x5EED_DE97
"""Third entry of every depth generator's seed: keeps depth draws independent of any
other (seed, step)-keyed randomness, such as batch sampling."""

HERMITE_NODES = 96
"""Gauss-Hermite nodes for the exact PLN depth distribution; the integrand is smooth in
tau, so 96 nodes are accurate to float precision for sigma up to about 2."""


def _generator(seed: int, step: int) -> np.random.Generator:
    # Seed words must be non-negative; the modulus keeps negative seeds distinct.
    return seeded_generator(seed % 2**64, step, DEPTH_SALT)


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise InputError(f"step must be a non-negative integer, got {step!r}")
    return int(step)


def _fmt(value: float) -> str:
    return f"{value:g}"


@lru_cache(maxsize=1)
def _hermite() -> tuple[np.ndarray, np.ndarray]:
    nodes, weights = np.polynomial.hermite.hermgauss(HERMITE_NODES)
    return nodes, weights / math.sqrt(math.pi)


def _pln_probability_table(means: np.ndarray, sigma: float, max_depth: int) -> np.ndarray:
    """P(K = k) for k = 1..max_depth under the clipped Poisson-lognormal law, one row per
    entry of `means`: [len(means), max_depth].

    Integrates the Poisson pmf over tau ~ N(log(mean) - sigma^2/2, sigma) with
    Gauss-Hermite quadrature; the mass of Poisson counts >= max_depth - 1 goes to
    K = max_depth (the clip)."""
    nodes, weights = _hermite()
    mu = np.log(np.asarray(means, dtype=np.float64)) - sigma**2 / 2  # [M]
    log_rates = mu[:, None] + math.sqrt(2.0) * sigma * nodes[None, :]  # [M, nodes]
    counts = np.arange(max_depth - 1)  # Poisson outcomes 0..max_depth-2 give K = 1..max_depth-1
    log_factorials = np.array([math.lgamma(k + 1) for k in counts])
    # The Poisson pmf from its log, written out: scipy.stats would add half a second to every
    # `depthdiag train` start for this one line.
    log_pmf = counts * log_rates[:, :, None] - np.exp(log_rates)[:, :, None] - log_factorials
    pmf = np.exp(log_pmf)  # [M, nodes, max_depth-1]
    below = np.einsum("n,mnk->mk", weights, pmf)  # [M, max_depth-1]
    clipped = np.clip(1.0 - below.sum(axis=1, keepdims=True), 0.0, None)  # [M, 1]
    probs = np.concatenate((below, clipped), axis=1)
    return probs / probs.sum(axis=1, keepdims=True)


@lru_cache(maxsize=4096)
def _pln_probabilities(mean: float, sigma: float, max_depth: int) -> tuple[float, ...]:
    """One row of `_pln_probability_table`, cached."""
    return tuple(_pln_probability_table(np.array([mean]), sigma, max_depth)[0].tolist())


def _pln_draw(rng: np.random.Generator, mean: float, sigma: float, max_depth: int) -> int:
    tau = rng.normal(math.log(mean) - sigma**2 / 2, sigma)
    return int(min(rng.poisson(math.exp(tau)) + 1, max_depth))


class _StationarySchedule:
    """Shared behaviour of schedules whose depth law is the same at every step; subclasses
    (frozen dataclasses with `seed` and `total_updates`) give `_draw` and `_distribution`."""

    @property
    def switch_step(self) -> None:
        return None

    def depth_at(self, step: int) -> int:
        return self._draw(_generator(self.seed, _check_step(step)))

    def depth_distribution(self, step: int) -> dict[int, float]:
        _check_step(step)
        return self._distribution()

    def average_distribution(self, updates: int | None = None) -> dict[int, float]:
        """Depth distribution averaged over steps [0, updates) (default: the whole run)."""
        _check_updates(self, updates)
        return self._distribution()

    def _draw(self, rng: np.random.Generator) -> int:
        """One depth drawn with `rng`, the generator of the step."""
        raise NotImplementedError

    def _distribution(self) -> dict[int, float]:
        """P(K = k) for every depth k with nonzero probability."""
        raise NotImplementedError


@dataclass(frozen=True)
class FixedSchedule(_StationarySchedule):
    """K = depth for every update."""

    depth: int
    """The training depth."""
    seed: int = 0
    """Unused (no randomness); kept so every schedule has the same fields."""
    total_updates: int = 1
    """Length of the run."""

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise InputError("depth must be >= 1")

    @property
    def spec(self) -> str:
        """Canonical spec string."""
        return f"fixed:{self.depth}"

    @property
    def max_depth(self) -> int:
        return self.depth

    def _draw(self, rng: np.random.Generator) -> int:
        return self.depth

    def _distribution(self) -> dict[int, float]:
        return {self.depth: 1.0}


@dataclass(frozen=True)
class UniformSchedule(_StationarySchedule):
    """K uniform in {low..high} each update."""

    low: int
    """Smallest depth."""
    high: int
    """Largest depth (inclusive)."""
    seed: int = 0
    """Seed of the depth draws."""
    total_updates: int = 1
    """Length of the run."""

    def __post_init__(self) -> None:
        if self.low < 1:
            raise InputError(f"depths must be >= 1, got low={self.low}")
        if self.high < self.low:
            raise InputError(f"range {self.low}-{self.high} is empty (need low <= high)")

    @property
    def spec(self) -> str:
        """Canonical spec string."""
        return f"uniform:{self.low}-{self.high}"

    @property
    def max_depth(self) -> int:
        return self.high

    def _draw(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high + 1))

    def _distribution(self) -> dict[int, float]:
        n = self.high - self.low + 1
        return {k: 1.0 / n for k in range(self.low, self.high + 1)}


@dataclass(frozen=True)
class PLNSchedule(_StationarySchedule):
    """Poisson-lognormal depth (Geiping et al. 2025); see the module docstring."""

    mean: float = 8.0
    """Mean of e^tau; E[K] = mean + 1 before clipping."""
    sigma: float = 0.5
    """Standard deviation of tau."""
    max: int = 16
    """Largest depth; larger draws are clipped to it."""
    seed: int = 0
    """Seed of the depth draws."""
    total_updates: int = 1
    """Length of the run."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean) and self.mean > 0):
            raise InputError(f"mean must be a finite number > 0, got {self.mean}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise InputError(f"sigma must be a finite number >= 0, got {self.sigma}")
        if self.max < 1:
            raise InputError(f"max must be >= 1, got {self.max}")

    @property
    def spec(self) -> str:
        """Canonical spec string."""
        return f"pln:mean={_fmt(self.mean)},sigma={_fmt(self.sigma)},max={self.max}"

    @property
    def max_depth(self) -> int:
        return self.max

    def _draw(self, rng: np.random.Generator) -> int:
        return _pln_draw(rng, self.mean, self.sigma, self.max)

    def _distribution(self) -> dict[int, float]:
        probs = _pln_probabilities(float(self.mean), float(self.sigma), self.max)
        return dict(enumerate(probs, start=1))


@dataclass(frozen=True)
class ProgressiveSchedule:
    """PLN depth whose mean rises from 1 to `mean` over the first `warmup` fraction
    (McLeish et al. 2025); see the module docstring for the exact curve."""

    mean: float = 8.0
    """PLN mean parameter reached at the end of the warmup."""
    sigma: float = 0.5
    """Standard deviation of tau."""
    max: int = 16
    """Largest depth; larger draws are clipped to it."""
    warmup: float = 0.75
    """Fraction of total_updates over which the mean rises; 0 means no rise."""
    shape: str = "1-sqrt"
    """'1-sqrt' or 'linear'."""
    seed: int = 0
    """Seed of the depth draws."""
    total_updates: int = 1
    """Length of the run; the curve is laid out over it."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean) and self.mean >= 1):
            raise InputError(f"mean must be a finite number >= 1 (the curve starts at 1), got {self.mean}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise InputError(f"sigma must be a finite number >= 0, got {self.sigma}")
        if self.max < 1:
            raise InputError(f"max must be >= 1, got {self.max}")
        if not 0 <= self.warmup <= 1:
            raise InputError(f"warmup must be in [0, 1], got {self.warmup}")
        if self.shape not in ("1-sqrt", "linear"):
            raise InputError(f"shape must be '1-sqrt' or 'linear', got {self.shape!r}")

    @property
    def spec(self) -> str:
        """Canonical spec string."""
        return (
            f"progressive:mean={_fmt(self.mean)},sigma={_fmt(self.sigma)},max={self.max},"
            f"warmup={_fmt(self.warmup)},shape={self.shape}"
        )

    @property
    def max_depth(self) -> int:
        return self.max

    @property
    def switch_step(self) -> None:
        return None

    def pln_mean_at(self, step: int) -> float:
        """The PLN mean parameter used at `step`."""
        step = _check_step(step)
        warmup_updates = self.warmup * self.total_updates
        progress = 1.0 if step >= warmup_updates else step / warmup_updates
        if self.shape == "linear":
            rise = progress
        else:
            rise = 1.0 - math.sqrt(1.0 - progress)
        return 1.0 + (self.mean - 1.0) * rise

    def depth_at(self, step: int) -> int:
        return _pln_draw(_generator(self.seed, _check_step(step)), self.pln_mean_at(step), self.sigma, self.max)

    def depth_distribution(self, step: int) -> dict[int, float]:
        probs = _pln_probabilities(self.pln_mean_at(step), float(self.sigma), self.max)
        return dict(enumerate(probs, start=1))

    def average_distribution(self, updates: int | None = None) -> dict[int, float]:
        """Depth distribution averaged over steps [0, updates) (default: the whole run)."""
        updates = _check_updates(self, updates)
        means = np.array([self.pln_mean_at(step) for step in range(updates)])  # [updates]
        total = np.zeros(self.max)
        for chunk in np.array_split(means, max(1, len(means) // 512)):  # bounds the pmf table's memory
            total += _pln_probability_table(chunk, float(self.sigma), self.max).sum(axis=0)
        return dict(enumerate((total / updates).tolist(), start=1))


FinishSchedule = UniformSchedule | PLNSchedule


@dataclass(frozen=True)
class FixedFirstSchedule:
    """K0 for the first round(switch * total_updates) updates, then the finish schedule."""

    k0: int = 4
    """Depth of the fixed phase."""
    switch: float = 0.8
    """Fraction of total_updates spent in the fixed phase (the switch step is rounded
    with Python's round, ties to even)."""
    finish: FinishSchedule = field(default_factory=lambda: UniformSchedule(1, 16))
    """Schedule of the finishing phase (uniform or pln), with the same seed and length."""
    seed: int = 0
    """Seed of the finishing phase's depth draws."""
    total_updates: int = 1
    """Length of the run."""

    def __post_init__(self) -> None:
        if self.k0 < 1:
            raise InputError(f"k0 must be >= 1, got {self.k0}")
        if not 0 <= self.switch <= 1:
            raise InputError(f"switch must be a fraction in [0, 1], got {_fmt(self.switch)}")
        if not isinstance(self.finish, (UniformSchedule, PLNSchedule)):
            raise InputError("finish must be a uniform or pln schedule")
        # The finishing phase draws from the run's own seed, whatever the finish was built with.
        object.__setattr__(self, "finish", replace(self.finish, seed=self.seed, total_updates=self.total_updates))

    @property
    def spec(self) -> str:
        """Canonical spec string."""
        return f"fixed-first:k0={self.k0},switch={_fmt(self.switch)},finish={self.finish.spec}"

    @property
    def max_depth(self) -> int:
        return max(self.k0, self.finish.max_depth)

    @property
    def switch_step(self) -> int:
        """First update of the finishing phase."""
        return round(self.switch * self.total_updates)

    def depth_at(self, step: int) -> int:
        if _check_step(step) < self.switch_step:
            return self.k0
        return self.finish.depth_at(step)

    def depth_distribution(self, step: int) -> dict[int, float]:
        if _check_step(step) < self.switch_step:
            return {self.k0: 1.0}
        return self.finish.depth_distribution(step)

    def average_distribution(self, updates: int | None = None) -> dict[int, float]:
        """Depth distribution averaged over steps [0, updates) (default: the whole run)."""
        updates = _check_updates(self, updates)
        fixed_steps = min(self.switch_step, updates)
        average = {k: p * (updates - fixed_steps) / updates for k, p in self.finish.average_distribution().items()}
        average[self.k0] = average.get(self.k0, 0.0) + fixed_steps / updates
        return dict(sorted(average.items()))


Schedule = FixedSchedule | UniformSchedule | PLNSchedule | ProgressiveSchedule | FixedFirstSchedule


def _check_updates(schedule: Schedule, updates: int | None) -> int:
    if updates is None:
        return schedule.total_updates
    if not 1 <= updates <= schedule.total_updates:
        raise InputError(f"updates must be in [1, {schedule.total_updates}] for this schedule, got {updates}")
    return updates


# --- parsing --------------------------------------------------------------------------------


def _int(key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InputError(f"{key} must be an integer, got {text!r}") from None


def _float(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{key} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise InputError(f"{key} must be finite, got {text!r}")
    return value


def _key_values(body: str, allowed: tuple[str, ...]) -> dict[str, str]:
    values: dict[str, str] = {}
    if not body:
        return values
    for item in body.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise InputError(f"expected key=value, got {item!r}")
        if key not in allowed:
            raise InputError(f"unknown key {key!r} (allowed: {', '.join(allowed)})")
        if key in values:
            raise InputError(f"key {key!r} given twice")
        values[key] = value
    return values


def _parse_uniform(body: str, seed: int, total_updates: int) -> UniformSchedule:
    if not body:
        return UniformSchedule(1, 16, seed, total_updates)
    low, sep, high = body.partition("-")
    if not sep:
        raise InputError(f"expected a range low-high such as 1-16, got {body!r}")
    return UniformSchedule(_int("low", low.strip()), _int("high", high.strip()), seed, total_updates)


def _parse_pln(body: str, seed: int, total_updates: int) -> PLNSchedule:
    values = _key_values(body, ("mean", "sigma", "max"))
    return PLNSchedule(
        mean=_float("mean", values.get("mean", "8")),
        sigma=_float("sigma", values.get("sigma", "0.5")),
        max=_int("max", values.get("max", "16")),
        seed=seed,
        total_updates=total_updates,
    )


def _parse_progressive(body: str, seed: int, total_updates: int) -> ProgressiveSchedule:
    values = _key_values(body, ("mean", "sigma", "max", "warmup", "shape"))
    return ProgressiveSchedule(
        mean=_float("mean", values.get("mean", "8")),
        sigma=_float("sigma", values.get("sigma", "0.5")),
        max=_int("max", values.get("max", "16")),
        warmup=_float("warmup", values.get("warmup", "0.75")),
        shape=values.get("shape", "1-sqrt"),
        seed=seed,
        total_updates=total_updates,
    )


def _parse_fixed(body: str, seed: int, total_updates: int) -> FixedSchedule:
    if not body:
        raise InputError("needs a depth, e.g. fixed:4")
    return FixedSchedule(_int("depth", body.strip()), seed, total_updates)


def _parse_fixed_first(body: str, seed: int, total_updates: int) -> FixedFirstSchedule:
    head, sep, finish_spec = body.partition("finish=")
    head = head.rstrip()  # "k0=4, finish=..." is as valid as "k0=4,finish=..."
    if sep and head and not head.endswith(","):
        raise InputError(f"expected key=value, got {body!r}")
    values = _key_values(head.rstrip(","), ("k0", "switch"))
    finish_spec = finish_spec.strip() if sep else "uniform:1-16"
    kind = finish_spec.partition(":")[0].strip()
    if kind not in ("uniform", "pln"):
        raise InputError(f"finish must be a uniform or pln spec (and the last key), got {finish_spec!r}")
    try:
        finish = PARSERS[kind](finish_spec.partition(":")[2].strip(), seed, total_updates)
    except ValueError as err:
        raise InputError(f"finish {finish_spec!r}: {err}") from None
    return FixedFirstSchedule(
        k0=_int("k0", values.get("k0", "4")),
        switch=_float("switch", values.get("switch", "0.8")),
        finish=finish,
        seed=seed,
        total_updates=total_updates,
    )


PARSERS = {
    "fixed": _parse_fixed,
    "uniform": _parse_uniform,
    "pln": _parse_pln,
    "progressive": _parse_progressive,
    "fixed-first": _parse_fixed_first,
}


def parse_schedule(spec: str, *, seed: int, total_updates: int) -> Schedule:
    """Build a schedule from its spec string (see the module docstring).

    Raises InputError with a one-line message such as
    "schedule 'fixed:0': depth must be >= 1"."""
    if isinstance(total_updates, bool) or not isinstance(total_updates, int) or total_updates < 1:
        raise InputError(f"schedule {spec!r}: total_updates must be a positive integer, got {total_updates!r}")
    kind, _, body = spec.strip().partition(":")
    kind = kind.strip()
    if kind not in PARSERS:
        raise InputError(f"schedule {spec!r}: unknown schedule {kind!r} (known: {', '.join(PARSERS)})")
    try:
        return PARSERS[kind](body.strip(), int(seed), total_updates)
    except ValueError as err:
        raise InputError(f"schedule {spec!r}: {err}") from None
