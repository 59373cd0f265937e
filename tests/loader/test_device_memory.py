"""Device memory accounting: what admission reads is consistent with allocations and
frees made at the same time on other threads."""

from __future__ import annotations

import platform
import threading

import pytest

from service.loader.devices.emulated import parse_emulated_devices

MiB = 1 << 20


def test_capacity_never_counts_a_buffer_twice_or_not_at_all() -> None:
    (device,) = parse_emulated_devices("EMU0=64MiB")
    total = device.memory().total
    stop = threading.Event()
    cycles = 0

    def churn() -> None:
        nonlocal cycles
        while not stop.is_set():
            device.alloc(device.default_buffer_type, 24 * MiB).free()
            cycles += 1

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(20_000):
            capacity, mem = device.capacity()
            # free memory plus what this process holds is the whole device, always
            assert capacity == total, (capacity, mem.free, device.held.nbytes)
    finally:
        stop.set()
        thread.join()
    assert cycles > 100  # the reads ran while buffers came and went
    assert device.held.nbytes == 0 and device.memory().free == total


def test_cpu_description_is_the_processor_name_ggml_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.loader.devices import cpu

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == "model name"]
    expected = names[0] if names and names[0] else platform.machine() or "CPU"
    cpu.cpu_description.cache_clear()
    assert cpu.CPUDevice().description == expected

    monkeypatch.setattr(cpu, "_read_small", lambda path: None)  # no /proc here
    cpu.cpu_description.cache_clear()
    try:
        assert cpu.CPUDevice().description == (platform.machine() or "CPU")
    finally:
        cpu.cpu_description.cache_clear()
