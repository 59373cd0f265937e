"""Text rendering of what the commands report: ``inspect`` tables, device lines, plans
and memory reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from service.loader.summary import printable, summarize, value_text

if TYPE_CHECKING:  # the plan and devices are imported by the commands that print them
    from service.loader.devices import Device
    from service.loader.placement import Plan
    from service.loader.weights import WeightIndex

MiB = 1 << 20


def columns(rows: Sequence[tuple[str, ...]], right: frozenset[int] = frozenset()) -> list[str]:
    """Rows as aligned text columns (plain text: fast for any number of rows); the
    columns numbered in ``right`` are right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


def inspect_lines(index: WeightIndex) -> list[str]:
    """``hoist inspect``'s text: the file's summary, its KV metadata table and its
    tensor table (offsets as ``split:offset`` for a split model)."""
    info = summarize(index, max_items=8)
    lines = [
        printable(info["path"]),
        f"file format = {info['file_format']}, {info['byte_order']}-endian",
        f"file type   = {info['file_type_name']}",
        f"file size   = {info['size']} of tensor data; {info['file_size_bytes']} bytes on disk",
        f"tensors     = {info['n_tensors']} ({', '.join(f'{t}: {n}' for t, n in info['tensor_types'].items())})",
    ]
    if len(info["splits"]) > 1:
        lines.append(f"splits      = {len(info['splits'])}")
        lines += [f"  {s['index'] + 1}: {printable(s['path'])} ({s['n_tensors']} tensors)" for s in info["splits"]]
    lines += ["", f"KV metadata: {len(info['metadata'])}"]
    kv = [("key", "type", "value")]
    kv += [(printable(e.key), e.type_name, value_text(e.value)) for e in index.metadata.kv.values()]
    lines += columns(kv)
    lines += ["", f"tensors: {info['n_tensors']}"]
    split = len(info["splits"]) > 1
    rows = [("name", "type", "ne", "bytes", "offset")]
    rows += [
        (
            printable(t["name"]),
            t["type"],
            str(tuple(t["ne"])),
            str(t["bytes"]),
            f"{t['split'] + 1}:{t['offset']}" if split else str(t["offset"]),
        )
        for t in info["tensors"]
    ]
    lines += columns(rows, right=frozenset({3, 4}))
    return lines


def device_line(d: Device) -> str:
    """One ``hoist devices`` line: name, type, free/total MiB, buffer types, caps, limits."""
    mem = d.memory()
    caps = ", ".join(k for k, v in d.caps.to_dict().items() if v) or "-"
    extra = f"; largest allocation {d.max_alloc_nbytes / MiB:.0f} MiB" if d.max_alloc_nbytes else ""
    if d.unsupported:
        extra += f"; refuses {'+'.join(sorted(d.unsupported))}"
    return (
        f"{d.name:<8} {d.type:<4} {mem.free / MiB:10.0f} / {mem.total / MiB:.0f} MiB free  "
        f"buffer types: {', '.join(b.name for b in d.buffer_types())}; caps: {caps}{extra}; "
        f"{printable(d.description)}"
    )


def layer_ranges(layers: dict[str, str]) -> str:
    """``input CPU; blk.0-8 CPU; blk.9-13 EMU0; output EMU1``."""
    parts: list[str] = [f"input {layers['input']}"]
    blocks = [(int(k[4:]), v) for k, v in layers.items() if k.startswith("blk.")]
    start = 0
    for i, (n, dev) in enumerate(blocks):
        if i + 1 == len(blocks) or blocks[i + 1][1] != dev:
            first = blocks[start][0]
            parts.append(f"blk.{first} {dev}" if first == n else f"blk.{first}-{n} {dev}")
            start = i + 1
    parts.append(f"output {layers['output']}")
    return "; ".join(parts)


def print_plan(p: Plan, *, verbose: bool = False) -> None:
    """A plan as llama.cpp's log lines: devices, layers and warnings on stderr, offload and
    buffer lines on stdout, then each device's use of its free memory on stderr."""
    from rich.markup import escape

    from service.cli.console import err, out

    devices = ", ".join(p.devices) or "none (CPU only)"
    err.print(f"devices: {devices}; load mode: {escape(p.load_mode_label)}")
    err.print(f"layers: {layer_ranges(p.layers)}")
    for w in p.warnings:
        err.print(f"[yellow]warning:[/yellow] {escape(w)}")
    if p.moved is not None and verbose:
        err.print(escape(p.moved.line()))
    for line in p.offload_lines():
        out.print(line)
    for line in p.buffer_lines():
        out.print(line)
    for u in p.device_use:
        verdict = "fits" if u.fits else "[red]DOES NOT FIT[/red]"
        mapped = f" (+{u.mapped / MiB:.2f} MiB mapped)" if u.mapped else ""
        err.print(f"{u.device}: {u.allocated / MiB:.2f} MiB{mapped} of {u.free / MiB:.2f} MiB free: {verdict}")
