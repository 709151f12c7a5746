"""What a writer has done so far: the counters both writers keep (the Ray writer actor and the
in-process writer of the plain torch.distributed runtime) and the metrics, the summary and the
write budget read. A writer fills the fields that apply to it; the rest stay zero."""

from __future__ import annotations

from dataclasses import dataclass

from layercheck.orchestrator.core.memory.footprint import WriterFootprint


@dataclass
class WriterStats:
    name: str = ""
    """The writer's name (the Ray actor's; empty in-process)."""
    written_versions: int = 0
    written_bytes: int = 0
    superseded: int = 0
    failures: int = 0
    queued: int = 0
    queued_bytes: int = 0
    write_s: float = 0.0
    """Seconds spent in successful writes (with ``written_bytes``: this writer's drain bandwidth)."""
    blocked_s: float = 0.0
    """Time the training thread waited for the byte bound (in-process writer)."""
    capture_bytes: int = 0
    """Of ``written_bytes``, survivors' captures (``origin="capture"``)."""
    captures_held: int = 0
    memory_versions: int = 0
    """Memory versions' shards held (``persistence.memory_period``: in memory only, never written)."""
    """Survivors' capture shards taken into this writer's memory (the writer actor's ``hold``)."""
    memory_bytes: int = 0
    """Shard bytes held in memory for recovery (own and mirror copies; see ``core/memory_tier``)."""
    memory_shards: int = 0
    mirror_bytes: int = 0
    """Of ``memory_bytes``: copies of files another node's writer wrote."""
    memory_evicted: int = 0
    """Shards let go to stay within ``persistence.memory_bytes``."""
    memory_versions_dropped: int = 0
    """Of ``memory_evicted``, memory versions' shards (``persistence.memory_period``): each left its
    layer without a held memory version until the next (the budget cannot hold a whole one)."""
    mirrors_sent: int = 0
    mirror_failures: int = 0
    host: WriterFootprint | None = None
    """What the writer's host memory holds, by kind, beside its process's resident memory (the
    writer actor; ``None`` in-process, where the rank's own process holds it)."""
