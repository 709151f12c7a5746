import pytest
import torch

from layercheck.policies.config_loader import ConfigError, from_mapping
from layercheck.workers.data.dataset import BYTE_VOCAB, DataConfig, SequenceDataset, tokenize


def dataset(n_tokens=640, seq_len=8, seed=0):
    return SequenceDataset(torch.arange(n_tokens), seq_len=seq_len, seed=seed)


def test_bundled_corpus_tokenizes_byte_level():
    tokens = tokenize(DataConfig())
    assert tokens.numel() > 100_000 and int(tokens.max()) < BYTE_VOCAB and tokens.dtype == torch.int64


def test_a_step_gives_each_rank_distinct_sequences():
    ds = dataset()
    kw = dict(step=4, world_size=2, micro_batch=2, grad_accum=2)
    rows = [
        tuple(r.tolist())
        for rank in range(2)
        for micro in range(2)
        for r in ds.micro_batch(micro=micro, rank=rank, **kw)
    ]
    assert len(set(rows)) == 8


def test_order_is_a_pure_function_of_the_step():
    a, b = dataset(seed=3), dataset(seed=3)
    kw = dict(micro=0, rank=1, world_size=2, micro_batch=3, grad_accum=1)
    late = a.micro_batch(step=50, **kw)  # a resumed run jumps straight to step 50
    for step in range(1, 50):
        b.micro_batch(step=step, **kw)
    assert torch.equal(late, b.micro_batch(step=50, **kw))
    assert not torch.equal(late, dataset(seed=4).micro_batch(step=50, **kw))


def test_each_epoch_is_a_new_permutation_of_all_sequences():
    ds = dataset(n_tokens=80, seq_len=8)  # 10 sequences
    first = [tuple(ds.sample(i).tolist()) for i in range(10)]
    second = [tuple(ds.sample(i).tolist()) for i in range(10, 20)]
    assert sorted(first) == sorted(second) and len(set(first)) == 10
    assert first != second


def test_missing_file_and_tiny_corpus_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path"):
        tokenize(DataConfig(path=str(tmp_path / "nope.txt")))
    with pytest.raises(ConfigError, match="data.seq_len: must be >= 2"):
        from_mapping(DataConfig, {"seq_len": 1}, field="data")
    (tmp_path / "t.txt").write_text("abc")
    with pytest.raises(ValueError, match="fewer than one sequence"):
        SequenceDataset.from_config(DataConfig(path=str(tmp_path / "t.txt"), seq_len=8))
