"""``keep_alive`` durations, as Ollama takes them: seconds as a number, or a Go duration
string (``"5m"``, ``"1h30m"``, ``"-1s"``); zero unloads at once, a negative value keeps
the model until it is unloaded."""

from __future__ import annotations

import math
import re

from service.errors import RequestError

FOREVER = -1.0
"""The keep-alive of a model kept until it is unloaded (any negative value means it)."""

MAX_KEEP_ALIVE_S = 1e9
"""Longest finite keep-alive, in seconds (about 31 years)."""

MAX_DURATION_CHARS = 64
"""Longest duration string taken."""

_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
_NUMBER = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)")


def _go_duration(text: str) -> float:
    """Seconds of a Go duration string (``time.ParseDuration``: a sign, then one or more
    decimal numbers each with a unit; ``"0"`` alone needs none)."""
    sign = -1.0 if text.startswith("-") else 1.0
    body = text[1:] if text[:1] in "+-" else text
    if body == "0":
        return 0.0
    if not body:
        raise ValueError
    seconds = 0.0
    pos = 0
    while pos < len(body):
        match = _PART.match(body, pos)
        if match is None:
            raise ValueError
        seconds += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    return sign * seconds


def parse_keep_alive(value: object) -> float:
    """Seconds a model stays resident after its last load: ``value`` as seconds (an int or
    float, or a string of one), or a Go duration string. Every negative value becomes
    :data:`FOREVER`.

    Raises:
        RequestError: not a number or duration, not finite, or longer than
            :data:`MAX_KEEP_ALIVE_S`.
    """
    if isinstance(value, bool):
        raise RequestError("keep_alive must be a number of seconds or a duration such as '5m', not a boolean")
    if isinstance(value, str):
        text = value.strip()
        if len(text) > MAX_DURATION_CHARS:
            raise RequestError(f"keep_alive is longer than {MAX_DURATION_CHARS} characters")
        try:
            seconds = float(text) if _NUMBER.fullmatch(text) else _go_duration(text)
        except ValueError:
            raise RequestError(
                f"keep_alive {text!r} is not a duration: give seconds, or a number with a unit "
                "(ns, us, ms, s, m, h) such as '5m' or '1h30m'"
            ) from None
    elif isinstance(value, (int, float)):
        try:
            seconds = float(value)
        except OverflowError:  # an integer of hundreds of digits
            seconds = math.inf if value > 0 else -math.inf
    else:
        raise RequestError("keep_alive must be a number of seconds or a duration string")
    if math.isnan(seconds):
        raise RequestError("keep_alive is not a number")
    if seconds < 0:
        return FOREVER
    if seconds > MAX_KEEP_ALIVE_S:
        raise RequestError(f"keep_alive is longer than {MAX_KEEP_ALIVE_S:.0f} s; give a negative value to keep it")
    return seconds
