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


def span(value: float) -> str:
    """``value`` seconds as a span a person waits through: ``45s``, ``9m30s``, ``10m``,
    ``1h05m``; whole seconds (``seconds`` below ten)."""
    if not math.isfinite(value) or value < 10:
        return seconds(value)
    whole = round(value)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m" + (f"{secs:02d}s" if secs else "")
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
