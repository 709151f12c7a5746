"""The rendezvous of an in-place run's ranks (orchestrator/core/recovery/rendezvous.py): a generation forms
when every rank is in, each rank gets rank 0's address, a survivor and a replacement form the next
one, and a rank that waits in vain raises instead of hanging."""

import os
import threading

import pytest

from layercheck.orchestrator.core.recovery.rendezvous import GroupAddress, Rendezvous, RendezvousTimeout


def arrive_all(point: Rendezvous, arrivals: list[tuple[int, int, str, int]], timeout_s: float = 5.0) -> dict:
    """Each (rank, world size, host, port) arrives from its own thread; their answers by rank."""
    answers: dict = {}

    def one(rank: int, world_size: int, host: str, port: int) -> None:
        try:
            answers[rank] = point.arrive(rank, world_size, host, port, timeout_s=timeout_s)
        except Exception as error:  # noqa: BLE001 - handed to the test
            answers[rank] = error

    threads = [threading.Thread(target=one, args=a) for a in arrivals]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def test_a_generation_forms_once_every_rank_is_in_and_each_gets_rank_0s_address():
    point = Rendezvous()
    answers = arrive_all(point, [(1, 3, "10.0.0.2", 0), (2, 3, "10.0.0.3", 0), (0, 3, "10.0.0.1", 29500)])
    assert set(answers.values()) == {GroupAddress(generation=1, host="10.0.0.1", port=29500, world_size=3)}
    assert point.generation == 1


def test_a_survivor_and_a_replacement_form_the_next_generation():
    point = Rendezvous()
    arrive_all(point, [(0, 2, "a", 1), (1, 2, "b", 0)])
    answers = arrive_all(point, [(1, 2, "c", 0), (0, 2, "a", 2)])  # rank 1 replaced, rank 0 kept its process
    assert {a.generation for a in answers.values()} == {2} and answers[1].port == 2


def test_a_rank_arriving_again_before_its_generation_forms_replaces_its_first_arrival():
    """A replacement that arrived and died is replaced by the next one for the same rank."""
    point = Rendezvous()
    with pytest.raises(RendezvousTimeout):
        point.arrive(0, 2, "dead", 1, timeout_s=0.05)
    answers = arrive_all(point, [(0, 2, "new", 7), (1, 2, "b", 0)])
    assert {(a.generation, a.host, a.port) for a in answers.values()} == {(1, "new", 7)}


def test_a_rank_whose_peers_never_come_raises_naming_them_and_leaves_no_trace():
    point = Rendezvous()
    with pytest.raises(RendezvousTimeout, match=r"generation 1 did not form in 0.05s \(ranks \[1, 2\] never arrived\)"):
        point.arrive(0, 3, "a", 1, timeout_s=0.05)
    # the late peers do not form a group with the rank that gave up
    late = arrive_all(point, [(1, 3, "b", 0), (2, 3, "c", 0)], timeout_s=0.05)
    assert all(isinstance(a, RendezvousTimeout) for a in late.values()) and point.generation == 0


def test_a_group_of_another_size_starts_a_new_generation():
    point = Rendezvous()
    with pytest.raises(RendezvousTimeout):
        point.arrive(1, 3, "b", 0, timeout_s=0.05)
    answers = arrive_all(point, [(0, 2, "a", 5), (1, 2, "b", 0)])
    assert {(a.world_size, a.port) for a in answers.values()} == {(2, 5)}


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        Rendezvous().arrive(2, 2, "a", 1, timeout_s=1)


def test_only_a_lost_peers_errors_send_a_survivor_into_an_in_place_recovery():
    """What a survivor's step raises when a peer dies (orchestrator/runtime/in_place.py); any other
    error ends the train function, and Ray Train replaces the rank."""
    import torch
    from ray.train.v2._internal.execution.checkpoint.sync_actor import SynchronizationBarrierResetError

    from layercheck.orchestrator.runtime.in_place import lost_a_peer

    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"
    assert lost_a_peer(RuntimeError(gloo))
    assert lost_a_peer(torch.distributed.DistNetworkError("Broken pipe"))
    assert lost_a_peer(SynchronizationBarrierResetError())
    # NCCL, released by an abort (ReplaceInPlace): torch 2.13 raises DistBackendError, older ones RuntimeError
    assert lost_a_peer(torch.distributed.DistBackendError("NCCL error: ncclCommAbort"))
    assert lost_a_peer(RuntimeError("NCCL communicator was aborted on rank 0."))
    assert not lost_a_peer(RuntimeError("CUDA out of memory"))
    assert not lost_a_peer(ValueError("Connection closed by peer"))  # not a collective's error type


def test_rank_0_publishes_the_port_its_store_listens_on_and_the_others_reach_it(monkeypatch):
    """Rank 0 serves the group's store on a port the OS gave it, and publishes that one. (It used
    to publish a port found free on the loopback and let go: Ray's runtime-env agent listened on
    the node's address at that port, and the other ranks waited on an HTTP server.) Two ranks
    form a group here through one rendezvous, each from its own thread, and share a key."""
    from layercheck.orchestrator.runtime import in_place

    point = Rendezvous()

    class _Supervisor:
        class rendezvous:  # noqa: N801 - stands for an actor method
            @staticmethod
            def remote(rank, world_size, host, port, timeout_s):
                return point.arrive(rank, world_size, host, port, timeout_s=timeout_s)

    monkeypatch.setattr(in_place.ray, "get", lambda value: value)
    monkeypatch.setattr(in_place.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    groups: dict = {}
    other = threading.Thread(target=lambda: groups.update(one=in_place.form_group(_Supervisor(), 1, 2, timeout_s=10)))
    other.start()
    groups[0] = in_place.form_group(_Supervisor(), 0, 2, timeout_s=10)
    other.join()
    zero, one = groups[0], groups["one"]
    assert zero.generation == one.generation == 1
    assert one.store.port == zero.store.port > 0
    one.store.set("from rank 1", "hello")
    assert zero.store.get("from rank 1") == b"hello"
    assert os.environ["MASTER_PORT"] == str(zero.store.port)
