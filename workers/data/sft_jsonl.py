"""Reading SFT examples from JSONL and turning each into tokens with a loss mask.

Each non-blank line is one example, either a ``{"prompt": str, "completion": str}`` pair (the
text is ``prompt + completion + eos``; the loss is on the completion and eos) or a
``{"messages": [{"role": str, "content": str}, ...]}`` chat rendered with the tokenizer's chat
template (the loss is on the assistant turns as the template renders them). Every malformed
line is an error naming the file and line, raised before any token is trained on.

Prompt and answer are tokenized as separate pieces and concatenated (as TRL does), so the
boundary between them is exact whatever the tokenizer merges across it. For chats the pieces
come from rendering growing prefixes of the conversation: the template must render a prefix of
a conversation as a prefix of its whole rendering, which every common template does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layercheck.policies.config_loader import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

ASSISTANT = "assistant"
#: The roles chat templates render (OpenAI's and Hugging Face's: ``developer`` and ``tool`` too;
#: Llama 3's ``ipython``). Another role is a typo that a lenient template would render as text.
CHAT_ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


class DataError(ConfigError):
    """The training data cannot be used as configured; the message names the field or the
    file and line."""


@dataclass(frozen=True)
class Record:
    """One parsed line: a prompt/completion pair or a chat."""

    line: int
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[dict[str, str], ...] | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True)
class Encoded:
    """An example's token ids and, per token, whether the loss is taken on it."""

    line: int
    ids: tuple[int, ...]
    loss: tuple[bool, ...]


def read_records(path: Path) -> list[Record]:
    """Every example of the JSONL file ``path``; blank lines are skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise DataError(f"data.path: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"data.path: {path} is not UTF-8 text: {exc}") from None
    records = [_parse(path, number, text) for number, text in _numbered(lines)]
    if not records:
        raise DataError(f"data.path: {path} holds no examples (no non-blank lines)")
    return records


def _numbered(lines: Sequence[str]) -> Iterator[tuple[int, str]]:
    for number, text in enumerate(lines, start=1):
        if text.strip():
            yield number, text


def _parse(path: Path, line: int, text: str) -> Record:
    where = f"{path} line {line}"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"data.path: {where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise DataError(f"data.path: {where}: expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        return Record(line=line, messages=_messages(where, row["messages"]))
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DataError(f"data.path: {where}: 'prompt' and 'completion' must be strings")
        if not completion:
            raise DataError(f"data.path: {where}: 'completion' is empty (nothing to train on)")
        return Record(line=line, prompt=prompt, completion=completion)
    raise DataError(f"data.path: {where}: expected keys 'prompt' and 'completion', or 'messages'; got {sorted(row)}")


def _messages(where: str, messages: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"data.path: {where}: 'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DataError(f"data.path: {where}: messages[{i}] must be an object with string 'role' and 'content'")
    odd = [(i, m["role"]) for i, m in enumerate(messages) if m["role"] not in CHAT_ROLES]
    if odd:
        i, role = odd[0]
        raise DataError(
            f"data.path: {where}: messages[{i}] has role {role!r}, which no chat template knows; "
            f"use one of {', '.join(CHAT_ROLES)}"
        )
    if not any(m["role"] == ASSISTANT for m in messages):
        raise DataError(f"data.path: {where}: no message has role 'assistant' (nothing to train on)")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


def check_chat_template(tokenizer: PreTrainedTokenizerBase, records: Sequence[Record], tokenizer_name: str) -> None:
    """Chats need a chat template: say so before tokenizing anything."""
    chats = [r.line for r in records if r.is_chat]
    if chats and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"data.tokenizer: {tokenizer_name} has no chat_template, but {len(chats)} example(s) are "
            f"chats (first at line {chats[0]}); use a tokenizer with a chat template or "
            f"prompt/completion lines"
        )


def encode(tokenizer: PreTrainedTokenizerBase, record: Record, path: Path) -> Encoded:
    """``record`` as tokens with its loss mask."""
    if record.is_chat:
        pieces = _chat_pieces(tokenizer, record, path)
        first_special = False  # a chat template writes its own BOS
    else:
        pieces = [(record.prompt or "", False), (record.completion or "", True)]
        first_special = True
    ids: list[int] = []
    loss: list[bool] = []
    for i, (text, trained) in enumerate(pieces):
        piece = tokenizer(text, add_special_tokens=first_special and i == 0)["input_ids"]
        ids += piece
        loss += [trained] * len(piece)
    if not record.is_chat and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)  # the model learns where an answer ends
        loss.append(True)
    return Encoded(line=record.line, ids=tuple(ids), loss=tuple(loss))


def _chat_pieces(tokenizer: PreTrainedTokenizerBase, record: Record, path: Path) -> list[tuple[str, bool]]:
    """The chat's rendering cut into (text, is an assistant turn) pieces."""
    messages = list(record.messages or ())
    where = f"{path} line {record.line}"

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages[:upto], tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:  # the template's own checks (role order, …) or a Jinja error
            raise DataError(f"data.path: {where}: the chat template cannot render it: {exc}") from None

    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != ASSISTANT:
            continue
        before, after = render(i, True), render(i + 1, False)
        if not (before.startswith(done) and after.startswith(before)):
            raise DataError(
                f"data.tokenizer: its chat template does not render the conversation at {where} "
                f"turn by turn (a prefix of the messages is not a prefix of the text), so its "
                f"assistant turns cannot be found"
            )
        pieces += [(before[len(done) :], False), (after[len(before) :], True)]
        done = after
    rest = render(len(messages), False)
    if not rest.startswith(done):
        raise DataError(f"data.tokenizer: its chat template does not render the conversation at {where} turn by turn")
    pieces.append((rest[len(done) :], False))
    return [(text, trained) for text, trained in pieces if text]
