"""Placement (gradsync.ps.client.place): large keys sliced evenly over all servers, small ones placed stably."""

from __future__ import annotations

from gradsync.ps.client import place


# ---- placement --------------------------------------------------------------------------------------------
def test_large_keys_are_sliced_evenly_over_all_servers() -> None:
    parts = place("big", 1_000_003, 4, 3)
    assert sorted(p.server for p in parts) == [0, 1, 2]
    assert [p.offset for p in parts] == [0, parts[0].numel, parts[0].numel + parts[1].numel]
    assert sum(p.numel for p in parts) == 1_000_003 and max(p.numel for p in parts) - min(p.numel for p in parts) <= 1
    small = place("bias", 10, 4, 3)
    assert len(small) == 1 and small == place("bias", 10, 4, 3)  # stable across calls (and processes: crc32)
    servers = {place(f"k{i}", 10, 4, 4)[0].server for i in range(40)}
    assert servers == {0, 1, 2, 3}
