"""Robust outliers across nodes (one slow node among many) from per-node measurements.

A mean and standard deviation are dragged by the very outlier we look for; the median and the median
absolute deviation (MAD) are not. Iglewicz & Hoaglin's modified z-score

    M_i = 0.6745 * (x_i - median) / MAD

is about a standard normal z-score for normal data (0.6745 is the 0.75 quantile of N(0, 1)), and
|M_i| > 3.5 is their recommended outlier cut-off.

Two guards make it usable on a cluster:
* MAD == 0 happens when more than half the nodes report the same value (identical hardware, integer or
  rounded metrics). Then the score uses the mean absolute deviation instead,
  M_i = (x_i - median) / (1.253314 * MeanAD) (1.253314 = sqrt(pi/2) makes MeanAD estimate sigma for
  normal data), the usual fallback; if every value equals the median there is no outlier.
* A relative floor `min_rel`: a value must also differ from the median by at least min_rel * |median|.
  On identical nodes the spread is tiny noise, so the scale is tiny and a 1% wobble can score 10;
  flagging it would drain healthy nodes.
"""

from __future__ import annotations

import statistics

MAD_SCALE = 0.6745
MEAN_AD_SCALE = 1.253314


def robust_outliers(
    values: dict[str, float], threshold: float = 3.5, higher_is_worse: bool = True, min_rel: float = 0.1
) -> dict[str, float]:
    """name -> modified z-score of the values that are worse than the rest (higher, or lower when
    `higher_is_worse` is False; the score is then sign-flipped so it is positive for worse)."""
    if len(values) < 3:
        return {}
    median = statistics.median(values.values())
    deviations = {name: x - median for name, x in values.items()}
    mad = statistics.median(abs(d) for d in deviations.values())
    if mad > 0:
        scale = mad / MAD_SCALE
    else:
        mean_ad = statistics.fmean(abs(d) for d in deviations.values())
        if mean_ad == 0:
            return {}
        scale = MEAN_AD_SCALE * mean_ad
    sign = 1.0 if higher_is_worse else -1.0
    outliers = {}
    for name, deviation in deviations.items():
        score = sign * deviation / scale
        if score > threshold and abs(deviation) >= min_rel * abs(median):
            outliers[name] = score
    return outliers
