"""Plans as JSON, encoded in slices: a plan of tens of thousands of tensors and buffers is
encoded a few thousand items at a time on a request thread, checking the request's
cancel token between slices, so that neither the event loop nor the GIL is held for long
and an abandoned request stops."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from service.api.errors import scrub_paths
from service.cancel import CancelToken, check

if TYPE_CHECKING:
    from service.loader.placement import Plan

SLICE = 2048
"""Items encoded between two checks of the cancel token."""


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _encode_list(items: Sequence[Any], item: Callable[[Any], Any], cancel: CancelToken | None) -> list[str]:
    parts = ["["]
    for k in range(0, len(items), SLICE):
        check(cancel)
        chunk = _dumps([item(x) for x in items[k : k + SLICE]])
        parts.append(("," if k else "") + chunk[1:-1])
    parts.append("]")
    return parts


def plan_json(
    plan: Plan, model: str, models_dir: str, *, tensors: bool = True, cancel: CancelToken | None = None
) -> bytes:
    """The plan as ``POST /v1/plans`` answers it (``model`` named as the request did,
    paths relative to the models directory), as UTF-8 JSON.

    Raises:
        RequestAbandonedError, WorkLimitError: from ``cancel``.
    """
    head = plan.to_dict(tensors=False)
    del head["buffers"]
    head["model"] = model
    head = scrub_paths(head, models_dir)
    check(cancel)
    parts = [_dumps(head)[:-1], ',"buffers":']
    parts += _encode_list(plan.buffers, lambda b: b.to_dict(), cancel)
    if tensors:
        parts.append(',"tensors":')
        parts += _encode_list(plan.tensors, lambda t: t.to_dict(), cancel)
    parts.append("}")
    return "".join(parts).encode()
