"""Percentile-bootstrap intervals, each with a fixed seed so that a rerun gives the same interval:
of a ratio of sums over resampled units (``evaluate``: loss per token over documents of unequal
length) and of a mean of per-unit values (``probe``: per-document means in a distance bin)."""

from __future__ import annotations

import numpy as np

BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0


def bootstrap_weights(units: int, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """[samples, units]: how often each unit is drawn in each bootstrap resample (a fixed seed)."""
    return np.random.default_rng(seed).multinomial(units, np.full(units, 1.0 / units), size=samples).astype(np.float64)


def ratio_interval(sums: np.ndarray, counts: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """95% percentile interval of sum(w * sums) / sum(w * counts) over the resamples ``weights``."""
    means = (weights @ sums) / np.maximum(weights @ counts, 1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def bootstrap_mean(
    values: np.ndarray, n_boot: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED, level: float = 0.95
) -> tuple[float, float, float]:
    """Mean of per-document values with a percentile-bootstrap interval that resamples documents."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(n_boot, values.size))].mean(axis=1)
    alpha = (1 - level) / 2
    return float(values.mean()), float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))
