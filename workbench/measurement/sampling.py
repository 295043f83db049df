"""Sampling error of quality metrics measured on a finite set of samples (the quick subset above all).

A metric measured on 256 test images is an estimate: another 256 would give a different number. Each function
returns the half-width of a 95 % interval, so a result reads "accuracy 0.980 +- 0.017", and two results whose
difference lies inside their combined error are labelled "within sampling error" rather than as a loss or gain.

- accuracies (a count of successes out of ``n``): the Wilson score interval, which stays inside [0, 1] and is
  honest near 0 and 1 where the normal approximation claims zero error;
- means of per-sample scores (cosine per document, loss per window): Student's t on the standard error;
- perplexity = exp(mean per-window loss): the t interval of the mean loss mapped through exp (half its width).

Differences between two models scored on the *same* samples are positively correlated, so combining the two
half-widths in quadrature (`within_error`) over-states the error of the difference: it errs towards "within
sampling error", never towards a phantom loss or gain.
"""
from __future__ import annotations

import math
from typing import Sequence

__all__ = ["wilson_halfwidth", "mean_halfwidth", "perplexity_halfwidth", "combined_halfwidth", "within_error"]

Z95 = 1.959963984540054


def wilson_halfwidth(successes: int, n: int, confidence: float = 0.95) -> float:
    """Half the width of the Wilson score interval of the proportion ``successes / n``."""
    if n <= 0:
        raise ValueError(f"wilson_halfwidth: n must be positive, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_halfwidth: successes must be in [0, {n}], got {successes}")
    z = _z(confidence)
    p = successes / n
    return z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))


def mean_halfwidth(values: Sequence[float], confidence: float = 0.95) -> float:
    """Half the width of the Student-t interval of the mean of ``values`` (nan for fewer than 2 values)."""
    import numpy as np
    from scipy.stats import t

    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return float("nan")
    return float(t.ppf(0.5 + confidence / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size))


def perplexity_halfwidth(window_losses: Sequence[float], confidence: float = 0.95) -> float:
    """Half the width of the interval exp(mean +- h) of the perplexity, from the mean loss of each window
    (windows rather than tokens: neighbouring tokens' losses are correlated, windows far less)."""
    import numpy as np

    v = np.asarray(window_losses, dtype=np.float64)
    h = mean_halfwidth(v, confidence)
    m = float(v.mean())
    return 0.5 * (math.exp(m + h) - math.exp(m - h))


def combined_halfwidth(a: float | None, b: float | None) -> float | None:
    """The half-width of a difference of two independent estimates; None when either error is unknown."""
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return None
    return math.hypot(a, b)


def within_error(a: float, a_err: float | None, b: float, b_err: float | None) -> bool | None:
    """True when ``a - b`` lies inside the combined 95 % error; None when an error is unknown."""
    h = combined_halfwidth(a_err, b_err)
    return None if h is None else abs(a - b) <= h


def _z(confidence: float) -> float:
    if confidence == 0.95:
        return Z95
    from scipy.stats import norm

    return float(norm.ppf(0.5 + confidence / 2))
