"""A writer's host-memory account (``core/memory/footprint.py``): the process's figures read from
``/proc``, the cache's bytes by kind, the parts of its RSS (which sum to it), the peaks, and the
run's view over several writers. The account against a real writer's process:
``tests/e2e/test_writer_host_memory.py``."""

from __future__ import annotations

from layercheck.orchestrator.core.memory.footprint import (
    RSS_PARTS,
    FootprintMeter,
    HeldByKind,
    ProcessMemory,
    held_by_kind,
    host_memory_view,
    process_memory,
)
from layercheck.orchestrator.core.memory.tier import HeldShard, ShardCache

MiB = 2**20


def held(layer: str, step: int, nbytes: int, *, origin: str = "policy", mirror: bool = False) -> HeldShard:
    return HeldShard(
        path=f"layers/{layer}/{step}-{origin}{'-m' if mirror else ''}",
        layer=layer,
        rank=0,
        step=step,
        origin=origin,
        data=memoryview(bytes(nbytes)),
        mirror=mirror,
    )


def test_the_process_figures_come_from_proc_status(tmp_path):
    status = tmp_path / "status"
    status.write_text(
        "Name:\tray::WriterActor\nVmHWM:\t  900000 kB\nVmRSS:\t  800000 kB\n"
        "RssAnon:\t  500000 kB\nRssFile:\t  120000 kB\nRssShmem:\t  180000 kB\n"
    )
    assert process_memory(status) == ProcessMemory(
        rss_bytes=800000 * 1024, anon_bytes=500000 * 1024, file_bytes=120000 * 1024, shmem_bytes=180000 * 1024
    )
    assert process_memory(status).own_bytes == 620000 * 1024
    assert process_memory(tmp_path / "absent") is None  # no /proc: the account has no process figures
    status.write_text("VmRSS:\t  800000 kB\n")  # a kernel that does not split RSS
    assert process_memory(status) is None


def test_the_cache_is_counted_by_kind():
    cache = ShardCache(10_000)
    cache.put(held("block.0", 4, 1000, origin="memory"))
    cache.put(held("block.1", 3, 700))
    cache.put(held("block.1", 3, 300, origin="capture"))
    cache.put(held("block.2", 5, 400, mirror=True))
    kinds = held_by_kind(cache)
    assert kinds == HeldByKind(memory_version_bytes=1000, stored_copy_bytes=1000, mirror_bytes=400)
    assert kinds.total_bytes == cache.stats().held_bytes


def test_the_rss_parts_sum_to_the_rss_and_the_peaks_keep_the_most():
    readings = iter(
        [
            ProcessMemory(rss_bytes=300 * MiB, anon_bytes=200 * MiB, file_bytes=100 * MiB, shmem_bytes=0),  # start
            ProcessMemory(rss_bytes=900 * MiB, anon_bytes=520 * MiB, file_bytes=100 * MiB, shmem_bytes=280 * MiB),
            ProcessMemory(rss_bytes=700 * MiB, anon_bytes=400 * MiB, file_bytes=100 * MiB, shmem_bytes=200 * MiB),
        ]
    )
    meter = FootprintMeter(lambda: next(readings))
    assert meter.runtime_bytes == 300 * MiB
    kinds = HeldByKind(memory_version_bytes=100 * MiB, stored_copy_bytes=50 * MiB, mirror_bytes=10 * MiB)
    busy = meter.measure(
        kinds, encoding_bytes=40 * MiB, capture_copy_bytes=20 * MiB, object_store_bytes=60 * MiB, mirror_sending_bytes=0
    )
    assert busy.accounted_bytes == (300 + 160 + 60) * MiB and busy.unaccounted_bytes == 100 * MiB
    parts = busy.rss_parts()
    assert parts is not None and tuple(parts) == RSS_PARTS and sum(parts.values()) == 900 * MiB
    assert parts["object_store"] == 280 * MiB and parts["in_flight"] == 60 * MiB
    idle = meter.measure(kinds, encoding_bytes=0, capture_copy_bytes=0, object_store_bytes=0, mirror_sending_bytes=0)
    assert idle.unaccounted_bytes == 40 * MiB
    assert (idle.peak_own_bytes, idle.peak_unaccounted_bytes) == (620 * MiB, 100 * MiB)


def test_without_proc_the_account_stands_alone():
    meter = FootprintMeter(lambda: None)
    footprint = meter.measure(
        HeldByKind(memory_version_bytes=5),
        encoding_bytes=0,
        capture_copy_bytes=0,
        object_store_bytes=0,
        mirror_sending_bytes=0,
    )
    assert footprint.runtime_bytes == 0 and footprint.unaccounted_bytes is None and footprint.rss_parts() is None
    assert host_memory_view([footprint])["own_bytes_max"] is None


def test_the_run_view_sums_what_writers_hold_and_takes_the_largest_process():
    def footprint(anon_mib: int, versions_mib: int):
        reads = iter(
            [ProcessMemory(rss_bytes=0, anon_bytes=100 * MiB, file_bytes=0, shmem_bytes=0)] * 1
            + [ProcessMemory(rss_bytes=0, anon_bytes=anon_mib * MiB, file_bytes=0, shmem_bytes=7 * MiB)]
        )
        return FootprintMeter(lambda: next(reads)).measure(
            HeldByKind(memory_version_bytes=versions_mib * MiB),
            encoding_bytes=0,
            capture_copy_bytes=0,
            object_store_bytes=MiB,
            mirror_sending_bytes=0,
        )

    view = host_memory_view([footprint(400, 290), footprint(300, 195)])
    assert view["writers"] == 2 and view["memory_version_bytes"] == 485 * MiB and view["object_store_bytes"] == 2 * MiB
    assert view["own_bytes_max"] == 400 * MiB and view["unaccounted_bytes_max"] == 10 * MiB
    assert view["runtime_bytes_max"] == 100 * MiB and view["shmem_bytes_max"] == 7 * MiB
    assert host_memory_view([]) == {}
