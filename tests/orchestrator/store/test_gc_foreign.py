"""GC deletes only files LayerCheck's own naming says it wrote: an uncommitted shard file or its
temporary under ``layers/<layer>/``, a commit record's temporary under ``manifest/``. A user's
file, another run nested in this one's tree, a file at a depth LayerCheck never writes: kept,
byte for byte, and reported."""

import pytest

from layercheck.orchestrator.cli.main import main
from layercheck.orchestrator.store.gc import GcConfig, collect_garbage
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.lease import StoreLease
from layercheck.orchestrator.store.run_dir import owned_file
from tests.support.store_helpers import PARAMS, cut_shards, even_cuts, layer_state, write_layer

#: Genuine leftovers of crashed writers, named as LayerCheck names them.
OLD_TMP = "layers/A/0000000050-rank00000of00002-0a0b0c0d.safetensors.1a2b3c4d.tmp"
OLD_RECORD_TMP = "manifest/A@0000000050-base-partial-0a0b0c0d.json.1a2b3c4d.tmp"
#: Files LayerCheck never writes where GC looks.
USER_FILES = {
    "layers/NOTES.txt": b"my notes about this run\n",
    "layers/A/stray.safetensors": b"not a LayerCheck name",
    "layers/A/sub/0000000050-rank00000of00002-0a0b0c0d.safetensors": b"a shard name one level too deep",
    "manifest/README.md": b"# what these records are\n",
}


def _outer_run(root):
    store = LayerStore.open(str(root), fsync=False)
    for layer, step, base in [("A", 20, True), ("B", 20, True), ("A", 30, False), ("A", 40, False), ("B", 40, False)]:
        write_layer(store, layer, step, base=base)
    store.fs.write_bytes("run.json", b"{}")
    return store


def _nested_run(root):
    """A second run whose storage was set inside the first run's layers/, as a fault trial did."""
    store = LayerStore.open(str(root), fsync=False)
    StoreLease.acquire(store.fs, run="exp2", settle_s=0).release()  # its epochs/
    for layer in ("embed", "block.0"):
        write_layer(store, layer, 20, base=True)
    write_layer(store, "block.0", 30)
    store.fs.write_bytes("run.json", b'{"name": "exp2"}')
    (root / "layers" / "embed" / "0000000040-rank00000of00002-0a0b0c0d.safetensors.1a2b3c4d.tmp").write_bytes(b"x")
    return store


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_gc_deletes_only_genuine_orphans_and_keeps_a_nested_run_and_user_files(tmp_path):
    root = tmp_path / "runs" / "a"
    store = _outer_run(root)
    nested = _nested_run(root / "layers" / "exp2")
    nested_versions = {r.version_id for r in nested.versions()}
    uncommitted = store.write_shard(cut_shards("A", 50, PARAMS, layer_state(PARAMS, seed=5), even_cuts(48, 2))[1])
    for rel in (OLD_TMP, OLD_RECORD_TMP):
        (root / rel).write_bytes(b"left by a crashed writer")
    for rel, data in USER_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    foreign = {rel: data for rel, data in _files(root).items() if rel.startswith("layers/exp2/") or rel in USER_FILES}

    report = collect_garbage(store, GcConfig(grace_s=0))

    assert set(report.orphans) == {uncommitted.path, OLD_TMP, OLD_RECORD_TMP}
    assert not any((root / rel).exists() for rel in report.orphans)
    assert sorted(report.foreign) == sorted(foreign) and len(foreign) == 16  # 12 of the nested run, 4 of users
    assert {rel: data for rel, data in _files(root).items() if rel in foreign} == foreign  # byte for byte
    assert {r.version_id for r in LayerStore.open(str(root / "layers" / "exp2")).versions()} == nested_versions
    assert {f"{r.layer}@{r.step}" for r in store.versions()} == {"A@40", "B@40"}  # pruned as before


def test_gc_command_says_what_it_kept_as_foreign(tmp_path, capsys):
    root = tmp_path / "runs" / "a"
    _outer_run(root)
    (root / "layers" / "NOTES.txt").write_bytes(b"mine")
    assert main(["gc", str(root), "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert "kept 1 file(s) LayerCheck did not write" in out and "layers/NOTES.txt" in out
    assert (root / "layers" / "NOTES.txt").read_bytes() == b"mine"


@pytest.mark.parametrize("base", [False, True], ids=["policy", "base"])
@pytest.mark.parametrize("origin", ["policy", "capture"])
def test_every_shard_name_layer_store_writes_is_its_own(tmp_path, base, origin):
    """Each origin a shard file can be stored under, base or not, and its temporary: GC's and
    --overwrite's one definition of a file LayerCheck wrote covers it, so GC collects it."""
    store = _outer_run(tmp_path / "run")
    shard = cut_shards("A", 50, PARAMS, layer_state(PARAMS, seed=5), even_cuts(48, 2))[0]
    receipt = store.write_shard(shard, base=base, origin=origin)  # never committed
    assert owned_file(receipt.path) and owned_file(receipt.path + ".0123abcd.tmp")
    assert collect_garbage(store, GcConfig(grace_s=0)).orphans == (receipt.path,)


@pytest.mark.parametrize(
    "rel,owned",
    [
        ("tokenizer/tokenizer.json", True),
        ("tokenizer/chat_template.jinja.0123abcd.tmp", True),
        ("tokenizer/sub/vocab.json", False),  # deeper than save_pretrained writes
        ("tokenizer/.hidden", False),
        ("tokenizers/tokenizer.json", False),
    ],
)
def test_the_runs_tokenizer_files_are_its_own_and_only_those(rel, owned):
    """The callback keeps the Trainer's tokenizer under ``tokenizer/`` (``run_tokenizer.py``):
    --overwrite deletes those files with the run's others, and nothing else there."""
    assert owned_file(rel) is owned
