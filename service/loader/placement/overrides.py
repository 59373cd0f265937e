"""Tensor buffer overrides (``-ot PATTERN=BUFT``) with bounded cost.

A pattern comes from a request, so compiling and matching it must not cost more than a
request may: before compiling, a pattern's length, its repetition counts and the size
of its expansion (repetitions multiply what they repeat) are bounded; compiled patterns
are cached by text; matching has a time limit per name and a budget per plan, and
stops when the plan's cancel token says so. Patterns use Python's ``re`` syntax (as
close to llama.cpp's ECMAScript ``std::regex`` as Python gets) and are compiled with
``regex``, which can match with a timeout and without holding the GIL.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Sequence
from typing import Any

from service.cancel import CancelToken, check
from service.errors import PlacementError, WorkLimitError, clip

try:  # the parser of the ``re`` module (``sre_parse`` before Python 3.11)
    import re._parser as _sre_parse  # type: ignore[import-not-found]
    from re._constants import MAXREPEAT  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    import sre_parse as _sre_parse
    from sre_constants import MAXREPEAT

MAX_OVERRIDES = 512
"""Most ``-ot`` patterns one plan or load may give (llama.cpp allows 4096, for
``--fit``, which hoist does not do)."""

MAX_PATTERN_CHARS = 256
"""Longest ``-ot`` pattern, in characters."""

MAX_REPEAT = 1000
"""Largest repetition count (``{m,n}``) in a pattern."""

MAX_PATTERN_SIZE = 10_000
"""Largest expansion of a pattern: items, with repetitions multiplying what they repeat
(``(?:a{100}){100}`` is 10,000)."""

MAX_TOTAL_SIZE = 50_000
"""Largest expansion of all of a plan's patterns together (bounds compile time)."""

MATCH_SECONDS = 0.25
"""Longest time one pattern may take to match one tensor name."""

MATCH_BUDGET_SECONDS = 1.0
"""Default time all of a plan's overrides may take to match all of its tensors."""

_COMPILED_CACHE = 256
"""Compiled patterns kept (by their text) for reuse across plans."""


def _expansion(items: Any, depth: int = 0) -> int:
    """Size of a parsed pattern once its repetitions are expanded.

    Raises:
        PlacementError: a repetition count above :data:`MAX_REPEAT`.
    """
    total = 0
    for op, av in items:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            lo, hi, sub = av
            for count in (lo, hi):
                if count != MAXREPEAT and count > MAX_REPEAT:
                    raise PlacementError(f"repetition count {count} is above the limit of {MAX_REPEAT}")
            times = hi if hi != MAXREPEAT else lo
            total += max(times, 1) * _expansion(sub, depth + 1)
        elif name == "SUBPATTERN":
            total += _expansion(av[3], depth + 1)
        elif name == "ATOMIC_GROUP":
            total += _expansion(av, depth + 1)
        elif name in ("ASSERT", "ASSERT_NOT"):
            total += _expansion(av[1], depth + 1)
        elif name == "BRANCH":
            total += sum(_expansion(b, depth + 1) for b in av[1])
        elif name == "GROUPREF_EXISTS":
            total += _expansion(av[1], depth + 1) + (_expansion(av[2], depth + 1) if av[2] else 0)
        else:
            total += 1
        if total > MAX_PATTERN_SIZE:
            break
    return total


@functools.lru_cache(maxsize=_COMPILED_CACHE)
def pattern_size(pattern: str) -> int:
    """The expansion of ``pattern`` (items, repetitions multiplying what they repeat),
    after refusing a pattern whose compilation could cost more than a request may.

    Raises:
        PlacementError: longer than :data:`MAX_PATTERN_CHARS`, invalid, a repetition
            count above :data:`MAX_REPEAT`, or an expansion above :data:`MAX_PATTERN_SIZE`.
    """
    shown = clip(pattern, 100)
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PlacementError(
            f"tensor override pattern '{shown}' is {len(pattern)} characters long, at most {MAX_PATTERN_CHARS}"
        )
    try:
        parsed = _sre_parse.parse(pattern)
    except (re.error, OverflowError, RecursionError, ValueError) as exc:
        raise PlacementError(f"invalid pattern '{shown}' in tensor override: {exc}") from None
    try:
        size = _expansion(parsed)
    except PlacementError as exc:
        raise PlacementError(f"tensor override pattern '{shown}': {exc.message}") from None
    if size > MAX_PATTERN_SIZE:
        raise PlacementError(
            f"tensor override pattern '{shown}' expands to more than {MAX_PATTERN_SIZE} items "
            "(nested repetitions multiply); simplify it"
        )
    return size


@functools.lru_cache(maxsize=_COMPILED_CACHE)
def compile_override(pattern: str) -> Any:
    """``pattern`` checked (:func:`pattern_size`) and compiled; identical patterns are
    compiled once.

    Raises:
        PlacementError: the pattern is refused or invalid.
    """
    import regex  # the third-party engine: imported when a pattern is first compiled

    pattern_size(pattern)
    try:
        return regex.compile(pattern, regex.VERSION0)
    except (regex.error, OverflowError, RecursionError, ValueError, MemoryError) as exc:
        raise PlacementError(f"invalid pattern '{clip(pattern, 100)}' in tensor override: {exc}") from None


class OverrideMatcher:
    """Finds the first override whose pattern is found in a tensor name (llama.cpp's
    ``std::regex_search`` over the ``-ot`` list), within a time budget.

    Args:
        patterns: the override patterns, in order.
        budget_s: seconds all matches together may take; None for no budget.
        cancel: checked before each tensor.

    Attributes:
        matches: tensors each pattern was the first to match.
    """

    def __init__(
        self,
        patterns: Sequence[str],
        *,
        budget_s: float | None = MATCH_BUDGET_SECONDS,
        cancel: CancelToken | None = None,
    ) -> None:
        self.patterns = list(patterns)
        self.compiled = [compile_override(p) for p in self.patterns]
        self.matches = [0] * len(self.patterns)
        self.budget_s = budget_s
        self.spent = 0.0
        self.cancel = cancel
        self._names = 0

    def first(self, name: str) -> int | None:
        """The index of the first pattern found in ``name``, or None.

        Raises:
            PlacementError: one match takes longer than :data:`MATCH_SECONDS`
                (catastrophic backtracking).
            WorkLimitError: the matches of this plan took longer than the budget.
            RequestAbandonedError: the cancel token was set.
        """
        if not self.compiled:
            return None
        check(self.cancel)
        self._names += 1
        for k, compiled in enumerate(self.compiled):
            limit = MATCH_SECONDS
            if self.budget_s is not None:
                limit = min(limit, self.budget_s - self.spent)
                if limit <= 0:
                    raise self._over_budget()
            started = time.perf_counter()
            try:
                found = compiled.search(name, timeout=limit, concurrent=True) is not None
            except TimeoutError:
                if limit < MATCH_SECONDS:
                    raise self._over_budget() from None
                raise PlacementError(
                    f"tensor override pattern '{clip(self.patterns[k], 100)}' takes too long to match '{name}' "
                    "(catastrophic backtracking); simplify it",
                    tensor=name,
                ) from None
            finally:
                self.spent += time.perf_counter() - started
            if found:
                self.matches[k] += 1
                return k
        return None

    def _over_budget(self) -> WorkLimitError:
        return WorkLimitError(
            f"the {len(self.patterns)} tensor override patterns took more than {self.budget_s:g} s "
            f"to match the first {self._names} tensors; use fewer or simpler patterns"
        )
