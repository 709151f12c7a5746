"""The handle Protocols (``orchestrator/runtime/handles.py``) say what each actor's methods take
and return: the type check holds every ``.remote(...)`` call to them, so they must be the actor's
own signatures, method for method (issue 57)."""

import inspect

import pytest

from layercheck.orchestrator.runtime.handles import PolicyHandle, RemoteMember, SupervisorHandle, WriterHandle
from layercheck.orchestrator.runtime.policy_actor import PolicyActor
from layercheck.orchestrator.runtime.supervisor_actor import SupervisorActor
from layercheck.orchestrator.runtime.writer_actor import WriterActor

PAIRS = [(SupervisorHandle, SupervisorActor), (PolicyHandle, PolicyActor), (WriterHandle, WriterActor)]
#: What a handle takes beyond its actor method's own parameters: Ray resolves a reference passed
#: as an argument, so the shard may be in the object store.
BY_REFERENCE = {("WriterHandle", "submit"), ("WriterHandle", "hold")}


def _members(handle: type) -> dict[str, RemoteMember]:
    return {name: member for name, member in vars(handle).items() if isinstance(member, RemoteMember)}


def _methods(actor) -> dict[str, inspect.Signature]:
    """The actor class's public methods (Ray keeps the class it decorated), ``self`` dropped and
    without the tracing keyword Ray adds to every method."""
    cls = actor.__ray_actor_class__
    out = {}
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_"):
            continue
        signature = inspect.signature(fn)
        params = [p for p in list(signature.parameters.values())[1:] if p.name != "_ray_trace_ctx"]
        out[name] = signature.replace(parameters=params)
    return out


def _signature(member: RemoteMember) -> inspect.Signature:
    signature = inspect.signature(member.signature)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


@pytest.mark.parametrize(("handle", "actor"), PAIRS, ids=lambda x: getattr(x, "__name__", ""))
def test_each_handle_has_every_public_method_of_its_actor(handle, actor):
    assert sorted(_members(handle)) == sorted(_methods(actor))


@pytest.mark.parametrize(("handle", "actor"), PAIRS, ids=lambda x: getattr(x, "__name__", ""))
def test_each_member_takes_and_returns_what_its_actor_method_does(handle, actor):
    methods = _methods(actor)
    for name, member in _members(handle).items():
        ours, theirs = _signature(member), methods[name]
        assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
            (p.name, p.kind, p.default) for p in theirs.parameters.values()
        ], name
        expected = [p.annotation for p in theirs.parameters.values()]
        if (handle.__name__, name) in BY_REFERENCE:
            expected = [f"{a} | ray.ObjectRef[{a}]" for a in expected]
        assert [p.annotation for p in ours.parameters.values()] == expected, name
        assert ours.return_annotation == theirs.return_annotation, name


def test_a_member_is_no_attribute_of_an_instance():
    """A Protocol's member describes a handle's method; read on anything but a Ray handle it says so."""

    class NotAHandle(SupervisorHandle):
        pass

    with pytest.raises(AttributeError, match="status"):
        NotAHandle().status  # noqa: B018 - the read is the test
