"""Regenerate the bundled SFT data set and its tokenizer (``examples/data/``).

    python scripts/make_sft_data.py

Writes ``examples/data/sft.jsonl`` (prompt/completion pairs and chats, interleaved: arithmetic,
unit conversions, string reversal, counting — deterministic and learnable) and
``examples/data/sft-tokenizer/`` (a small byte-level BPE trained on that data, with a chat
template), so ``AutoTokenizer.from_pretrained(dir, local_files_only=True)`` loads it and nothing
is downloaded. The output is a pure function of ``SEED``: rerunning it rewrites the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 1234
PAIRS = 400
CHATS = 300
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
# Each turn is "<|role|>\n{content}</s>"; the conversation opens with <s>. An assistant turn's
# tokens (content and its </s>) are what SFT trains on.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "lemon",
    "piano",
    "rocket",
    "garden",
    "silver",
    "window",
    "planet",
    "candle",
    "forest",
    "mirror",
    "pepper",
    "orange",
    "bridge",
    "castle",
    "dragon",
]
UNITS = [("km", "m", 1000), ("m", "cm", 100), ("kg", "g", 1000), ("h", "min", 60), ("min", "s", 60), ("l", "ml", 1000)]


def task(rng: random.Random) -> tuple[str, str]:
    """One question and its answer."""
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"What is {a} + {b}?", str(a + b)
    if kind == 1:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"What is {a} times {b}?", str(a * b)
    if kind == 2:
        big, small, factor = rng.choice(UNITS)
        n = rng.randint(1, 20)
        return f"Convert {n} {big} to {small}.", f"{n} {big} = {n * factor} {small}"
    if kind == 3:
        word = rng.choice(WORDS)
        return f"Reverse the word '{word}'.", word[::-1]
    word = rng.choice(WORDS)
    return f"How many letters are in '{word}'?", str(len(word))


def pair(rng: random.Random) -> dict[str, str]:
    question, answer = task(rng)
    return {"prompt": f"Q: {question}\nA:", "completion": f" {answer}"}


def chat(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You answer with the result only."})
    for _ in range(rng.randint(1, 3)):
        question, answer = task(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def examples(seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    rows = [pair(rng) for _ in range(PAIRS)] + [chat(rng) for _ in range(CHATS)]
    rng.shuffle(rows)
    return rows


def chat_text(row: dict) -> str:
    return "<s>" + "".join(f"<|{m['role']}|>\n{m['content']}</s>" for m in row["messages"])


def build_tokenizer(rows: list[dict]):
    """A byte-level BPE over the data set's own text, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [r["prompt"] + r["completion"] if "prompt" in r else chat_text(r) for r in rows]
    core.train_from_iterator(texts, trainer=trainer)
    bos = core.token_to_id("<s>")
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "examples" / "data")
    args = parser.parse_args()
    rows = examples()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "sft.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tokenizer = build_tokenizer(rows)
    # the chat template inside tokenizer_config.json, where every transformers version looks
    tokenizer.save_pretrained(str(args.out / "sft-tokenizer"), save_jinja_files=False)
    print(f"wrote {len(rows)} examples and a {len(tokenizer)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
