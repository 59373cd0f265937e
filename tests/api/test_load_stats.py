"""The job view shows where a load's bytes came from and which stage bounded it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.api.test_loads import put, wait_for
from tests.helpers import Fixture


@pytest.mark.parametrize("mode", ["mmap", "none", "direct-io"])
def test_the_job_shows_cache_and_disk_bytes_and_the_bound(
    live_server: str, models_dir: Path, all_types_fixture: Fixture, mode: str
) -> None:
    name = put(models_dir, all_types_fixture)
    with httpx.Client(base_url=live_server) as client:
        location = client.post("/v1/loads", json={"model": name, "load_mode": mode}).headers["location"]
        done = wait_for(client, location, {"succeeded", "failed", "cancelled"})
        assert done["state"] == "succeeded", done
        stats = done["stats"]
        # every tensor byte is counted once: from the cache, from disk, or not told apart
        sources = stats["bytes_from_cache"] + stats["bytes_from_disk"] + stats["bytes_unprobed"]
        assert sources == done["bytes_total"] == sum(stats["bytes_by_branch"].values())
        assert stats["reads_in_flight"] >= 1
        assert stats["stages"]["read"]["bytes"] == done["bytes_total"]
        assert stats["bound"]["stage"] in stats["stages"]
        assert stats["bound"]["seconds"] == max(s["seconds"] for s in stats["stages"].values())
