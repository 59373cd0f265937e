"""Moving tensor data to where a plan puts it (llama.cpp's buffer creation and
``load_all_data``), as an asyncio pipeline.

``load_model`` plans, checks the plan against the devices' free memory, maps the files
and allocates the buffers (:mod:`.layout`), then runs the tensor jobs on one loader
thread (:mod:`.worker`: extents, reader tasks, staging pools, uploaders, validators)
while the event loop receives progress (:mod:`.boundary`). Cancelling the awaiting
task, or returning ``False`` from the progress callback, stops the loader at the next
chunk; every buffer, mapping, lock, staging buffer, thread and file descriptor the load
took is released before the error propagates.

Load modes: ``mmap`` (CPU tensors are views of a read-only mapping), ``mmap+mlock`` (and
their pages are locked as the load proceeds), ``none`` (read into allocated buffers),
``mlock`` (read into host buffers that are locked), ``direct-io`` (read with ``O_DIRECT``,
falling back to buffered reads where the filesystem refuses it), ``auto`` (mmap unless a
chosen device cannot use mapped memory). Lazy tensors are mapped whatever the mode.

The names below are imported from their modules with their first use: the load
options from :mod:`.options` (light: what a request or a command line needs), the rest
from :mod:`.load`, with numpy, the planner and the loader thread's modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.lazy import lazy_exports

if TYPE_CHECKING:
    from service.loader.pipeline.load import check_budget, check_loadable, load_model, load_plan, staging_nbytes
    from service.loader.pipeline.options import (
        DEFAULT_CHUNK_NBYTES,
        DEFAULT_STAGING_BUFFERS,
        LoadOptions,
        Progress,
        ProgressCallback,
    )

__all__ = [
    "DEFAULT_CHUNK_NBYTES",
    "DEFAULT_STAGING_BUFFERS",
    "LoadOptions",
    "Progress",
    "ProgressCallback",
    "check_budget",
    "check_loadable",
    "staging_nbytes",
    "load_model",
    "load_plan",
]

_HOME = {
    "DEFAULT_CHUNK_NBYTES": "options",
    "DEFAULT_STAGING_BUFFERS": "options",
    "LoadOptions": "options",
    "Progress": "options",
    "ProgressCallback": "options",
    "check_budget": "load",
    "check_loadable": "load",
    "staging_nbytes": "load",
    "load_model": "load",
    "load_plan": "load",
}
"""The module of this package that defines each exported name."""


__getattr__ = lazy_exports(__name__, _HOME)
