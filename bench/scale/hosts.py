"""A rank host: one Ray actor process that runs many simulated ranks, each the product's rank side
of the protocol — :class:`~layercheck.workers.loop.StepProtocol` over a
:class:`~layercheck.orchestrator.runtime.ray_coordinator.RayCoordinator` (with its sending and
putting threads) on a :class:`~layercheck.bench.scale.synthetic.SyntheticRank` — joined to the run's
supervisor, handing over to its node's writer actor, and recovering in place as a survivor would
(capture, rendezvous, join, load the composite) or as a replacement would (join, load).

A rank is a protocol, not a process: the host runs its ranks' steps one after another, so the
host's CPU per step is the rank side's cost times the ranks it holds (the table reports it apart
from the control actors')."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import ray

from layercheck.bench.scale import countfs
from layercheck.bench.scale.instruments import CallCounts, CountingHandle, TimedCoordinator
from layercheck.bench.scale.synthetic import SyntheticRank
from layercheck.orchestrator.logs import configure_process_logging
from layercheck.orchestrator.runtime.resume_ref import resume_of
from layercheck.workers.collective_abort import PeerLost
from layercheck.workers.loop import StepProtocol

logger = logging.getLogger(__name__)

#: How long a rank waits at the rendezvous of an in-place recovery (``cluster.regroup_timeout_s``'s role).
REGROUP_TIMEOUT_S = 600.0
#: How long the end of the run waits for each host's hand-overs to leave (the run's drain then waits for the writes).
FLUSH_S = 120.0
#: The simulated learning rate (only the drift reports carry it).
LR = 1e-5


@dataclass(frozen=True, kw_only=True)
class HostConfig:
    """What every simulated rank is given (a run config's ``persistence`` part, and the run)."""

    world_size: int
    numel: dict[str, int]
    drift_every: int
    storage_uri: str
    max_inflight_bytes: int
    memory_period: int
    capture_timeout_s: float = 30.0


@ray.remote(num_cpus=0)
class RankHost:
    def __init__(self, ranks: list[int], config: HostConfig, policy: Any, supervisor: Any) -> None:
        configure_process_logging()
        self.config = config
        self.node_id = ray.get_runtime_context().get_node_id()
        self.calls = CallCounts()
        self.policy = CountingHandle(policy, "policy", self.calls)
        self.supervisor = CountingHandle(supervisor, "supervisor", self.calls)
        self._plain_supervisor = supervisor
        self.latencies: list[float] = []
        self.states = {r: self._new_rank(r) for r in ranks}
        self.protocols: dict[int, StepProtocol] = {}
        self.coordinators: dict[int, TimedCoordinator] = {}

    def _new_rank(self, rank: int) -> SyntheticRank:
        return SyntheticRank(
            self.config.numel, rank=rank, world_size=self.config.world_size, drift_every=self.config.drift_every
        )

    def pid(self) -> int:
        return os.getpid()

    def ranks(self) -> list[int]:
        return sorted(self.states)

    # ---- joining ---------------------------------------------------------------------------
    def join(self, attempt: int, *, regroup: bool = False) -> dict[str, Any]:
        """Every rank of this host joins the run's group of ``attempt`` (``regroup``: meets the
        others at the supervisor's rendezvous first, as an in-place run's ranks do), loads the
        composite where the group recovers, and gets a new coordinator; the seconds each part took."""
        started = time.monotonic()
        if regroup:
            host = ray.util.get_node_ip_address()
            ray.get(
                [
                    self.supervisor.rendezvous.remote(r, self.config.world_size, host, 0, REGROUP_TIMEOUT_S)
                    for r in self.states
                ]
            )
        formed = time.monotonic()
        answers = {
            r: self.supervisor.join.remote(r, self.config.world_size, f"sim{r}-a{attempt}", "synthetic")
            for r in self.states
        }
        resumes = {r: resume_of(ray.get(answer)) for r, answer in answers.items()}
        joined = time.monotonic()
        writers = ray.get(self.supervisor.writers_for.remote(self.node_id))
        load_s = []
        for r, resume in resumes.items():
            if resume.records is not None:
                load_s.append(self._load(r, resume))
        loaded = time.monotonic()
        for r, resume in resumes.items():
            self._start_protocol(r, writers, resume.attempt)
        start_steps = {resume.start_step for resume in resumes.values()}
        return {
            "rendezvous_s": formed - started,
            "join_s": joined - formed,
            "load_s": loaded - joined,
            "rank_load_s": load_s,
            "start_step": min(start_steps),
            "start_steps": sorted(start_steps),
            "attempt": max(resume.attempt for resume in resumes.values()),
        }

    def _load(self, rank: int, resume: Any) -> float:
        from layercheck.orchestrator.runtime.train_fn import recover  # (imports the engines: only on a recovery)

        started = time.monotonic()
        recover(
            self.states[rank],
            self.config.storage_uri,
            False,
            resume.records,
            self._plain_supervisor,
            rank,
            overlays=resume.overlays,
        )
        return time.monotonic() - started

    def _start_protocol(self, rank: int, writers: list[Any], attempt: int) -> None:
        old = self.coordinators.pop(rank, None)
        if old is not None:
            old._sender.shutdown(wait=False)
            old._putter.shutdown(wait=False)
        writer = writers[rank % len(writers)]
        coordinator = TimedCoordinator(
            latencies=self.latencies,
            rank=rank,
            policy=self.policy,
            writer=CountingHandle(writer, "writer", self.calls),
            supervisor=self.supervisor,
            max_inflight_bytes=self.config.max_inflight_bytes,
            attempt=attempt,
            capture_timeout_s=self.config.capture_timeout_s,
            memory_period=self.config.memory_period,
        )
        self.coordinators[rank] = coordinator
        self.protocols[rank] = StepProtocol(self.states[rank].layout, coordinator, rank=rank)

    def hand_over_initial(self) -> float:
        """Every rank hands its step-0 state over (what ``attach`` does for an own loop); returns
        once every hand-over has reached its writer."""
        started = time.monotonic()
        for protocol in self.protocols.values():
            protocol.hand_over_initial()
        for coordinator in self.coordinators.values():
            coordinator.wait_sent(FLUSH_S)  # (put and submitted: the writers' drain then covers them)
        return time.monotonic() - started

    # ---- training --------------------------------------------------------------------------
    def run_steps(self, first: int, last: int, start_at: float, step_s: float) -> dict[str, Any]:
        """Steps ``first..last`` of every rank here, step ``i`` begun at ``start_at + (i - first) *
        step_s`` (wall clock; at once if this host is late). Per step, the host's busy seconds."""
        busy, late = [], []
        cpu_before = time.process_time()
        for step in range(first, last + 1):
            due = start_at + (step - first) * step_s
            wait = due - time.time()
            if wait > 0:
                time.sleep(wait)
            late.append(max(0.0, -wait))
            began = time.monotonic()
            for rank, protocol in self.protocols.items():
                drift = self.states[rank].step(step, LR)
                protocol.after_step(step, drift, loss=0.0, lr=LR, compute_s=0.0)
            busy.append(time.monotonic() - began)
        return {
            "busy_s": busy,
            "late_s": late,
            "cpu_s": time.process_time() - cpu_before,
            "waited_s": {r: p.result.coordination_s for r, p in self.protocols.items()},
            "stall_s": {r: p.result.stall_s for r, p in self.protocols.items()},
        }

    def take_measures(self) -> dict[str, Any]:
        """Calls made and decision latencies since the last take."""
        latencies, self.latencies[:] = list(self.latencies), []
        return {"calls": self.calls.take(), "latencies": latencies}

    def store_counts(self) -> dict[str, int]:
        """This process's store requests so far (a recovering rank reads the store)."""
        return countfs.snapshot()

    # ---- the failure -------------------------------------------------------------------------
    def fail(self, dead: int | None) -> dict[str, Any]:
        """Rank ``dead`` (if it is here) dies after its last step: it hands nothing over, and comes
        back as a new process (zero state) that joins fresh. Every other rank here sees the loss as
        its next step's collective would, and hands its capture over (``StepProtocol.on_failure``)."""
        started = time.monotonic()
        if dead in self.states:
            coordinator = self.coordinators.pop(dead)
            coordinator.wait_sent(FLUSH_S)  # its report of the last step left before it died (t_fail is that step)
            coordinator._sender.shutdown(wait=False, cancel_futures=True)
            coordinator._putter.shutdown(wait=False, cancel_futures=True)
            del self.protocols[dead]
            self.states[dead] = self._new_rank(dead)
        for protocol in self.protocols.values():
            protocol.on_failure(PeerLost(f"rank {dead} was lost (simulated)"))
        return {"capture_s": time.monotonic() - started}

    def finish(self) -> dict[str, Any]:
        """The last step's decision carried out, and everything handed over written."""
        started = time.monotonic()
        for protocol in self.protocols.values():
            protocol.finish()
        deadline = started + FLUSH_S  # (one bound for the host: what is unwritten by then is not waited for)
        for coordinator in self.coordinators.values():
            coordinator.flush(max(0.0, deadline - time.monotonic()))
        return {"finish_s": time.monotonic() - started}
