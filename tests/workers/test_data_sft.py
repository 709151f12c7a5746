"""SFT data: answer-only labels, padding and packing, the resumable order, and bad input found
on the driver before any worker starts. Uses the bundled tokenizer through AutoTokenizer."""

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from layercheck.orchestrator.cli.main import main
from layercheck.orchestrator.core.run_checks import check_data
from layercheck.orchestrator.core.run_config import load_run_config
from layercheck.policies.config_loader import ConfigError, from_mapping
from layercheck.workers.data.batch import IGNORE_INDEX, Batch, model_inputs
from layercheck.workers.data.dataset import DataConfig, load_data
from layercheck.workers.data.sft import load_tokenizer
from layercheck.workers.data.sft_jsonl import DataError

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "examples" / "data" / "sft-tokenizer")
SFT_TOML = ROOT / "examples" / "sft.toml"
PAIR = {"prompt": "Q: What is 3 + 4?\nA:", "completion": " 7"}
CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Reverse 'abc'."},
        {"role": "assistant", "content": "cba"},
    ]
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def sft(path: str, **kw) -> DataConfig:
    return DataConfig(format="sft", path=path, tokenizer=TOKENIZER, **kw)


def rows_of(config: DataConfig):
    dataset, _ = load_data(config)
    return dataset.rows


def decode_labels(tok, labels: torch.Tensor) -> str:
    return tok.decode(labels[labels != IGNORE_INDEX])


def test_prompt_tokens_are_masked_and_the_answer_and_eos_kept(tmp_path, tok):
    rows = rows_of(sft(write_jsonl(tmp_path / "d.jsonl", [PAIR]), seq_len=32))
    ids, labels, mask = rows.input_ids[0], rows.labels[0], rows.attention_mask[0]
    prompt = tok(PAIR["prompt"])["input_ids"]  # with the tokenizer's BOS
    answer = tok(PAIR["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(prompt) + len(answer)
    assert ids[:n].tolist() == prompt + answer
    assert labels[: len(prompt)].tolist() == [IGNORE_INDEX] * len(prompt)
    assert labels[len(prompt) : n].tolist() == answer
    # padding: attended nowhere, trained on nowhere
    assert mask.tolist() == [1] * n + [0] * (32 - n)
    assert labels[n:].tolist() == [IGNORE_INDEX] * (32 - n) and ids[n:].tolist() == [tok.pad_token_id] * (32 - n)


def test_a_chat_trains_on_its_assistant_turns_only(tmp_path, tok):
    rows = rows_of(sft(write_jsonl(tmp_path / "d.jsonl", [CHAT]), seq_len=64))
    ids, labels, mask = rows.input_ids[0], rows.labels[0], rows.attention_mask[0]
    assert tok.decode(ids[mask.bool()]) == tok.apply_chat_template(CHAT["messages"], tokenize=False)
    assert decode_labels(tok, labels) == "4</s>cba</s>"
    kept = labels != IGNORE_INDEX
    assert torch.equal(labels[kept], ids[kept])  # the model shifts labels itself


def test_packing_places_every_example_once_and_masks_the_padding(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [PAIR, CHAT] * 10)
    padded, packed = rows_of(sft(path, seq_len=64)), rows_of(sft(path, seq_len=64, packing=True))
    assert packed.count < padded.count == 20
    assert int(packed.attention_mask.sum()) == int(padded.attention_mask.sum())  # no token lost or added
    assert sorted(packed.labels[packed.labels != IGNORE_INDEX].tolist()) == sorted(
        padded.labels[padded.labels != IGNORE_INDEX].tolist()
    )
    pads = packed.attention_mask == 0
    assert (packed.labels[pads] == IGNORE_INDEX).all()
    # real tokens first, then padding, in every row
    assert all(row.tolist() == sorted(row.tolist(), reverse=True) for row in packed.attention_mask)
    again = rows_of(sft(path, seq_len=64, packing=True))
    assert torch.equal(again.input_ids, packed.input_ids)


def test_too_long_examples_are_cut_or_dropped_and_counted(tmp_path, tok, caplog):
    long_prompt = {"prompt": "Q: " + "What is 1 + 1? " * 20 + "\nA:", "completion": " 2"}
    path = write_jsonl(tmp_path / "d.jsonl", [PAIR, long_prompt])
    with caplog.at_level(logging.WARNING, logger="layercheck.workers.data.sft"):
        _, summary = load_data(sft(path, seq_len=16))
    assert summary.rows == 1 and (summary.fit.truncated, summary.fit.dropped) == (1, 1)
    assert "1 of 2 examples are longer than seq_len=16" in caplog.text
    with pytest.raises(DataError, match=r"data.seq_len: 4 is too short: all 2 examples were dropped"):
        load_data(sft(path, seq_len=4))


def test_order_is_resumable_and_the_same_at_any_world_size(tmp_path):
    dataset, _ = load_data(sft(write_jsonl(tmp_path / "d.jsonl", [PAIR, CHAT] * 20), seq_len=64, seed=5))

    def step_rows(step, world_size, micro_batch, grad_accum):
        return [
            tuple(r)
            for rank in range(world_size)
            for micro in range(grad_accum)
            for r in dataset.micro_batch(
                step=step, micro=micro, rank=rank, world_size=world_size, micro_batch=micro_batch, grad_accum=grad_accum
            ).input_ids.tolist()
        ]

    for step in (1, 7, 30):  # 40 rows, global batch 8: step 30 is in a later epoch
        a, b = step_rows(step, 2, 2, 2), step_rows(step, 4, 2, 1)
        assert sorted(a) == sorted(b) == sorted(step_rows(step, 1, 8, 1))
    fresh, _ = load_data(sft(str(tmp_path / "d.jsonl"), seq_len=64, seed=5))
    kw = dict(micro=1, rank=1, world_size=2, micro_batch=2, grad_accum=2)
    late = fresh.micro_batch(step=30, **kw)  # a resumed run jumps straight to its step
    assert isinstance(late, Batch) and torch.equal(late.labels, dataset.micro_batch(step=30, **kw).labels)


def test_a_token_tensor_still_feeds_labels_equal_to_inputs():
    ids = torch.arange(6).view(2, 3)
    inputs = model_inputs(ids, torch.device("cpu"))
    assert set(inputs) == {"input_ids", "labels"} and inputs["labels"] is inputs["input_ids"]


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"prompt": "a", "completion": "b"', r"d.jsonl line 2: not JSON"),
        ('{"question": "a", "answer": "b"}', r"d.jsonl line 2: expected keys 'prompt' and 'completion', or 'messages'"),
        ('{"prompt": "a", "completion": 3}', r"d.jsonl line 2: 'prompt' and 'completion' must be strings"),
        ('{"messages": [{"role": "user"}]}', r"d.jsonl line 2: messages\[0\] must be an object"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', r"d.jsonl line 2: no message has role 'assistant'"),
        ("[1, 2]", r"d.jsonl line 2: expected a JSON object"),
        (
            '{"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
            r"d.jsonl line 2: messages\[0\] has role 'robot', which no chat template knows; use one of system",
        ),
    ],
)
def test_a_bad_line_names_the_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "d.jsonl", [PAIR, line])
    with pytest.raises(DataError, match=message):
        load_data(sft(path))


def test_an_empty_data_set_is_an_error(tmp_path):
    with pytest.raises(DataError, match="holds no examples"):
        load_data(sft(write_jsonl(tmp_path / "d.jsonl", ["", "  "])))


def test_chats_need_a_tokenizer_with_a_chat_template(tmp_path):
    bare = tmp_path / "tok"
    shutil.copytree(TOKENIZER, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    path = write_jsonl(tmp_path / "d.jsonl", [PAIR, CHAT])
    with pytest.raises(
        DataError,
        match=r"data.tokenizer: .*tok has no chat_template, but 1 example\(s\) are chats "
        r"\(first at line 2\)",
    ):
        load_data(DataConfig(format="sft", path=path, tokenizer=str(bare)))
    load_data(DataConfig(format="sft", path=write_jsonl(tmp_path / "p.jsonl", [PAIR]), tokenizer=str(bare)))


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="data.tokenizer: must be a local Hugging Face tokenizer directory"):
        from_mapping(DataConfig, {"format": "sft", "path": "x.jsonl"}, field="data")
    with pytest.raises(ConfigError, match="data.path: must be a JSONL file"):
        from_mapping(DataConfig, {"format": "sft", "tokenizer": TOKENIZER}, field="data")
    with pytest.raises(ConfigError, match="data.format: must be one of"):
        from_mapping(DataConfig, {"format": "parquet"}, field="data")
    with pytest.raises(DataError, match="data.tokenizer: cannot load a tokenizer"):
        load_data(DataConfig(format="sft", path="x.jsonl", tokenizer="/nonexistent/tok"))


def test_the_sft_example_validates_on_the_driver(monkeypatch):
    monkeypatch.chdir(ROOT)  # its paths are relative to the repository root
    config = load_run_config(SFT_TOML, {"steps": 5}).with_absolute_storage()
    assert Path(config.data.path).is_absolute() and Path(config.data.tokenizer).is_absolute()
    summary = check_data(config)
    assert (
        summary.rows == 700 and summary.fit.dropped == 0 and summary.vocab_size == config.model.hf_config["vocab_size"]
    )
    packed = check_data(dataclasses.replace(config, data=dataclasses.replace(config.data, packing=True)))
    assert packed.rows < summary.rows
    small = load_run_config(SFT_TOML, {"model.hf_config.vocab_size": 256})
    with pytest.raises(ConfigError, match=r"model.hf_config.vocab_size: must be >= the tokenizer's vocabulary \(512"):
        check_data(small)


def test_layercheck_train_refuses_bad_data_before_starting_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    bad = write_jsonl(tmp_path / "bad.jsonl", [PAIR, PAIR, "not json"])
    storage = tmp_path / "store"
    code = main(
        ["train", str(SFT_TOML), "--set", f"data.path={bad}", "--set", f"storage={storage}", "--set", "metrics.port=0"]
    )
    assert code == 2
    assert "bad.jsonl line 3: not JSON" in capsys.readouterr().err
    assert not storage.exists()  # refused before the store was prepared or Ray was started


def test_the_bundled_data_and_tokenizer_are_what_the_script_writes(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_sft_data", ROOT / "scripts" / "make_sft_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr("sys.argv", ["make_sft_data.py", "--out", str(tmp_path)])
    script.main()
    shipped = ROOT / "examples" / "data"
    for name in ("sft.jsonl", "sft-tokenizer/tokenizer.json", "sft-tokenizer/tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), name
    size = sum(p.stat().st_size for p in [shipped / "sft.jsonl", *(shipped / "sft-tokenizer").iterdir()])
    assert size < 200_000
