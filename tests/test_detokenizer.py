"""Incremental detokenization: deltas concatenate to the full decode, never end inside a
multi-byte character, and never release text that a stop string later removes."""

from __future__ import annotations

import pytest
from tiny_models import tiny_tokenizer

from deltaserve.cluster.core.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    return Tokenizer(path)


TEXT = "héllo 你好 world, café über straße 数据!"


def test_deltas_rebuild_the_text_without_broken_characters(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: "))
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_spanning_tokens_is_never_released(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["好 wo"])
    released = ""
    for i in ids:
        released += detok.add([i])
        assert "好 wo" not in released and not released.endswith("好")
        if detok.stopped_by:
            break
    released += detok.flush()
    assert released == "héllo 你"
    assert detok.stopped_by == "好 wo"


def test_partial_stop_match_is_released_when_it_diverges(tokenizer):
    ids = tokenizer.encode("hello world")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["wox"])
    out = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert out == "hello world" and detok.stopped_by is None


def test_include_stop_string(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["lo w"], include_stop_str_in_output=True)
    out = "".join(detok.add([i]) for i in tokenizer.encode("hello world")) + detok.flush()
    assert out == "hello w"
