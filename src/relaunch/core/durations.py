"""Durations as people read them: the one place that rounds seconds for a message."""

from __future__ import annotations

import math


def seconds(value: float) -> str:
    """``value`` seconds for a message: ``1.5s``, ``600s``, ``0.25s``, never ``1.49274s``.

    At most one decimal from a second up (none from 100 s up), two significant digits below a
    second, no trailing zeros: a computed duration (a deadline's remainder, a product of
    settings) reads as the round number a person would say.
    """
    if not math.isfinite(value):
        return f"{value}s"
    size = abs(value)
    if size >= 100:
        text = str(round(value))
    elif size >= 1:
        text = f"{value:.1f}".rstrip("0").rstrip(".")
    else:
        text = f"{value:.2g}"
    return text + "s"
