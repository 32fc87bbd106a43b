"""Statistics for comparing strategies: the mean with a t-distribution confidence interval, the paired
t-test (``scipy.stats.ttest_rel``) of a strategy against a baseline on measurements paired by a key such as
``(seed, step)``, and the distribution-free interval of a median (order statistics: for step-time ratios,
whose tails a busy machine makes heavy).

Callers drop warm-up steps first (:func:`drop_warmup` helps). Degenerate inputs never raise or give NaN:
fewer than two values or zero variance give ``None`` (or a p-value of 1.0 for identical measurements) with
the reason in ``reason``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Summary:
    """Mean of ``n`` measurements and its ``confidence`` interval (Student's t, ``n - 1`` d.o.f.)."""

    mean: float | None
    ci_low: float | None
    ci_high: float | None
    n: int
    std: float | None
    confidence: float
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Comparison:
    """A strategy against a baseline over ``n`` paired measurements.

    ``mean`` and ``baseline_mean`` are over the pairs; ``diff`` is the mean of ``strategy - baseline``
    and ``[ci_low, ci_high]`` its confidence interval; ``relative_diff = diff / baseline_mean`` (-0.2 is
    20% lower than the baseline); ``p_value`` is the two-sided paired t-test's. ``unpaired`` counts
    measurements whose key had no partner and were left out.
    """

    mean: float | None
    baseline_mean: float | None
    diff: float | None
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    statistic: float | None
    n: int
    relative_diff: float | None
    unpaired: int
    confidence: float
    reason: str = ""

    @property
    def significant(self) -> bool:
        """True when the p-value exists and is below ``1 - confidence``."""
        return self.p_value is not None and self.p_value < 1.0 - self.confidence

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "significant": self.significant}


@dataclass(frozen=True)
class MedianInterval:
    """Median of ``n`` values and an interval that holds the population median with probability at least
    ``confidence``, whatever the distribution: two order statistics chosen by the binomial(n, 1/2) tails."""

    median: float | None
    low: float | None
    high: float | None
    n: int
    confidence: float
    reason: str = ""


def _scipy_stats() -> Any:
    try:
        from scipy import stats
    except ImportError as err:
        raise ImportError("remat.bench.stats needs scipy: pip install scipy") from err
    return stats


def _finite(values: Iterable[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    bad = [v for v in out if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{what} contains non-finite values {bad[:3]}: drop failed or diverged runs first")
    return out


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1); got {confidence}")


def _mean_interval(values: list[float], confidence: float) -> tuple[float, float, float, float]:
    """``(mean, std, ci_low, ci_high)`` for at least two values."""
    n = len(values)
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(_scipy_stats().t.ppf(0.5 + confidence / 2, n - 1)) * std / math.sqrt(n)
    return mean, std, mean - half, mean + half


def summarize(values: Iterable[float], confidence: float = 0.95) -> Summary:
    """Mean and t-interval of ``values``."""
    _check_confidence(confidence)
    data = _finite(values, "values")
    n = len(data)
    if n == 0:
        return Summary(None, None, None, 0, None, confidence, "no measurements")
    if n == 1:
        return Summary(data[0], None, None, 1, None, confidence, "one measurement: no interval")
    mean, std, low, high = _mean_interval(data, confidence)
    reason = "zero variance: the interval is a point" if std == 0 else ""
    return Summary(mean, low, high, n, std, confidence, reason)


def median_interval(values: Iterable[float], confidence: float = 0.95) -> MedianInterval:
    """The median of ``values`` and its distribution-free ``confidence`` interval ``[x_(k), x_(n+1-k)]`` (sorted,
    1-based), with ``k`` the largest rank whose binomial(n, 1/2) tail ``P(B < k)`` is at most ``(1 - confidence)/2``.
    Too few values for any such ``k`` (fewer than 6 at 95%) give no interval, with the reason."""
    _check_confidence(confidence)
    data = sorted(_finite(values, "values"))
    n = len(data)
    if n == 0:
        return MedianInterval(None, None, None, 0, confidence, "no measurements")
    median = statistics.median(data)
    tail, rank, below = (1.0 - confidence) / 2, 0, 0.0
    while rank < n // 2:  # below = P(B <= rank) = P(B < rank + 1)
        below += math.comb(n, rank) / 2.0**n
        if below > tail:
            break
        rank += 1
    if rank == 0:
        too_few = f"{n} values are too few for a {confidence:.0%} interval"
        return MedianInterval(median, None, None, n, confidence, too_few)
    return MedianInterval(median, data[rank - 1], data[n - rank], n, confidence)


def _pair(
    strategy: Mapping[Hashable, float] | Sequence[float], baseline: Mapping[Hashable, float] | Sequence[float]
) -> tuple[list[float], list[float], int]:
    if isinstance(strategy, Mapping) != isinstance(baseline, Mapping):
        raise TypeError("pass both strategy and baseline as mappings (paired by key) or both as sequences")
    if isinstance(strategy, Mapping) and isinstance(baseline, Mapping):
        keys = [k for k in strategy if k in baseline]
        unpaired = len(strategy) + len(baseline) - 2 * len(keys)
        return [strategy[k] for k in keys], [baseline[k] for k in keys], unpaired
    if len(strategy) != len(baseline):
        raise ValueError(
            f"sequences pair by position and need equal lengths; got {len(strategy)} and "
            f"{len(baseline)} (pass mappings keyed by (seed, step) to pair by key)"
        )
    return list(strategy), list(baseline), 0


def paired_test(
    strategy: Mapping[Hashable, float] | Sequence[float],
    baseline: Mapping[Hashable, float] | Sequence[float],
    confidence: float = 0.95,
) -> Comparison:
    """Paired t-test of ``strategy`` against ``baseline``.

    Mappings are paired by key (e.g. ``(seed, step)``; keys present on one side only are counted in
    ``unpaired``), sequences by position.
    """
    _check_confidence(confidence)
    a, b, unpaired = _pair(strategy, baseline)
    a, b = _finite(a, "strategy"), _finite(b, "baseline")
    n = len(a)

    def result(**fields: Any) -> Comparison:
        base: dict[str, Any] = dict(
            mean=None,
            baseline_mean=None,
            diff=None,
            ci_low=None,
            ci_high=None,
            p_value=None,
            statistic=None,
            relative_diff=None,
            reason="",
        )
        return Comparison(**{**base, **fields}, n=n, unpaired=unpaired, confidence=confidence)

    if n == 0:
        return result(reason="no paired measurements")
    mean, base_mean = math.fsum(a) / n, math.fsum(b) / n
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    diff = math.fsum(diffs) / n
    common = dict(
        mean=mean, baseline_mean=base_mean, diff=diff, relative_diff=diff / base_mean if base_mean != 0 else None
    )
    if n == 1:
        return result(**common, reason="one pair: no test")
    if all(d == diffs[0] for d in diffs):
        if diffs[0] == 0:
            return result(
                **common,
                ci_low=0.0,
                ci_high=0.0,
                p_value=1.0,
                statistic=0.0,
                reason="identical measurements: no difference",
            )
        return result(
            **common,
            ci_low=diff,
            ci_high=diff,
            reason=f"every pair differs by exactly {diffs[0]:g}: zero variance, the t-test is undefined",
        )
    _, _, low, high = _mean_interval(diffs, confidence)
    test = _scipy_stats().ttest_rel(a, b)
    return result(**common, ci_low=low, ci_high=high, p_value=float(test.pvalue), statistic=float(test.statistic))


def drop_warmup(rows: Iterable[Mapping[str, Any]], warmup: int, step_key: str = "step") -> list[Mapping[str, Any]]:
    """Rows whose ``step_key`` is at least ``warmup`` (steps counted from 0)."""
    return [row for row in rows if row[step_key] >= warmup]


def _grouped(
    rows: Iterable[Mapping[str, Any]], value: str, strategy_key: str, by: Sequence[str]
) -> dict[Any, dict[tuple[Any, ...], float]]:
    """strategy -> key -> value, averaging rows that share a key (e.g. steps when pairing by seed)."""
    sums: dict[Any, dict[tuple[Any, ...], list[float]]] = {}
    for row in rows:
        missing = [k for k in (strategy_key, value, *by) if k not in row]
        if missing:
            raise KeyError(f"row {dict(row)} lacks {missing}")
        key = tuple(row[k] for k in by)
        sums.setdefault(row[strategy_key], {}).setdefault(key, []).append(float(row[value]))
    return {s: {k: math.fsum(v) / len(v) for k, v in per_key.items()} for s, per_key in sums.items()}


def summarize_by(
    rows: Iterable[Mapping[str, Any]],
    *,
    value: str,
    strategy_key: str = "strategy",
    by: Sequence[str] = ("seed", "step"),
    confidence: float = 0.95,
) -> dict[Any, Summary]:
    """Per strategy, the :func:`summarize` of ``value`` over its keys ``by`` (duplicates averaged)."""
    return {
        s: summarize(per_key.values(), confidence) for s, per_key in _grouped(rows, value, strategy_key, by).items()
    }


def compare(
    rows: Iterable[Mapping[str, Any]],
    *,
    value: str,
    baseline: Any,
    strategy_key: str = "strategy",
    by: Sequence[str] = ("seed", "step"),
    confidence: float = 0.95,
) -> dict[Any, Comparison]:
    """Every strategy in ``rows`` against ``baseline`` by :func:`paired_test`, pairing rows on ``by``.

    ``by=("seed",)`` first averages each seed's steps, so the test is over seeds.
    """
    groups = _grouped(rows, value, strategy_key, by)
    if baseline not in groups:
        raise ValueError(f"baseline {baseline!r} has no rows; strategies present: {sorted(map(str, groups))}")
    return {s: paired_test(per_key, groups[baseline], confidence) for s, per_key in groups.items() if s != baseline}
