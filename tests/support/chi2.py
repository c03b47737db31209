"""Pearson's chi-square test with its p-value, in plain Python (no scipy): the statistic over the
cells of an expected distribution and the upper tail of the chi-square law (the regularised upper
incomplete gamma function Q(df / 2, stat / 2), by its series below a + 1 and by Lentz's continued
fraction above)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Hashable, Iterable, Mapping


def _lower_series(a: float, x: float) -> float:
    """P(a, x) by its power series (x < a + 1)."""
    term = total = 1.0 / a
    n = a
    for _ in range(10_000):
        n += 1
        term *= x / n
        total += term
        if abs(term) < abs(total) * 1e-15:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _upper_fraction(a: float, x: float) -> float:
    """Q(a, x) by its continued fraction (x >= a + 1), Lentz's method."""
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        step = d * c
        h *= step
        if abs(step - 1.0) < 1e-15:
            break
    return h * math.exp(-x + a * math.log(x) - math.lgamma(a))


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X chi-square with ``df`` degrees of freedom."""
    if stat <= 0:
        return 1.0
    a, x = df / 2.0, stat / 2.0
    return 1.0 - _lower_series(a, x) if x < a + 1 else _upper_fraction(a, x)


def chi2_test(samples: Iterable[Hashable], expected: Mapping[Hashable, float],
              min_expected: float = 5.0) -> tuple[float, int, float]:
    """``(statistic, df, p-value)`` of the samples against ``expected`` (probabilities summing to 1).

    Cells whose expected count is below ``min_expected`` are pooled into one cell (dropped if the
    pool itself stays below it). A sample outside the support of ``expected`` gives p = 0."""
    counts = Counter(samples)
    n = sum(counts.values())
    if any(key not in expected or expected[key] <= 0 for key in counts):
        return math.inf, 0, 0.0
    cells, pool_obs, pool_exp = [], 0, 0.0
    for key, prob in expected.items():
        if prob <= 0:
            continue
        if n * prob < min_expected:
            pool_obs += counts.get(key, 0)
            pool_exp += n * prob
        else:
            cells.append((counts.get(key, 0), n * prob))
    if pool_exp >= min_expected:
        cells.append((pool_obs, pool_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return stat, df, chi2_sf(stat, df) if df > 0 else 1.0
