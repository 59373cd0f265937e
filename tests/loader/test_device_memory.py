"""Device memory accounting: what admission reads is consistent with allocations and
frees made at the same time on other threads."""

from __future__ import annotations

import threading

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
