"""Tokenizer from the model directory (`tokenizer.json` through the `tokenizers` library), and the
incremental detokenizer that streams text without splitting a multi-byte character and without
ever emitting text that a stop string later removes."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

# Prompt tokens decoded together with the first output tokens, so that the first delta carries the
# spacing the tokenizer gives in context.
_CONTEXT_TOKENS = 6


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self._tok = HFTokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    Text is released only when it decodes without a trailing U+FFFD (an incomplete UTF-8 sequence),
    and the longest tail that could still become a stop string is held back until it can't."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # decoded output text so far (not yet cut at a stop string)
        self.emitted = 0  # characters of self.text already released
        self.stopped_by: str | None = None

    def add(self, token_ids: list[int]) -> str:
        """Feed new output ids; returns the text that can be released now."""
        if self.stopped_by is not None:
            return ""
        for token in token_ids:
            self.ids.append(token)
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
            full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release()

    def _release(self) -> str:
        for stop in self.stop:
            # only the part that could newly contain the stop string needs searching
            at = self.text.find(stop, max(0, self.emitted - len(stop) + 1))
            if at != -1 and (self.stopped_by is None or at < self._stop_at):
                self.stopped_by, self._stop_at = stop, at
        if self.stopped_by is not None:
            end = self._stop_at + (len(self.stopped_by) if self.include_stop else 0)
            self.text = self.text[:end]
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._held_back())

    def _held_back(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out

    def flush(self) -> str:
        """At the end of the request: release whatever was held back."""
        return self._emit(len(self.text))
