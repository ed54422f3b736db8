"""IncrementalDetokenizer against full decodes, and check_stop_strings."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from tests.utils import train_tiny_tokenizer

MULTIBYTE_TEXT = "café 中文 🙂 naïve 日本語 🎉 ok"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tiny_tokenizer()


def _stream(
    detok: IncrementalDetokenizer, token_ids: list[int], rng: random.Random | None = None
) -> list[str]:
    """Feed ``token_ids`` in chunks of 1 (or random 1..3 with ``rng``); return the deltas."""
    deltas = []
    i = 0
    while i < len(token_ids):
        k = rng.randint(1, 3) if rng else 1
        deltas.append(detok.add_tokens(token_ids[i : i + k]))
        i += k
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_streams_match_full_decode(
    tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool
) -> None:
    rng = random.Random(0)
    prompts = [[], tokenizer.encode("Hello, how are you?"), tokenizer.encode("x", add_special_tokens=False)]
    for _ in range(150):
        token_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 40))]
        detok = IncrementalDetokenizer(
            tokenizer, rng.choice(prompts), skip_special_tokens=skip_special_tokens
        )
        deltas = _stream(detok, token_ids, rng)
        held = detok.flush()
        assert "".join(deltas) + held == detok.output_text
        assert detok.output_text == tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert detok.num_tokens == len(token_ids)


def test_multibyte_chars_never_stream_replacement_char(tokenizer: PreTrainedTokenizerFast) -> None:
    token_ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    # The tiny vocabulary splits these characters into bytes: single tokens decode to U+FFFD.
    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"))
    deltas = _stream(detok, token_ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens were held until their character completed
    assert "".join(deltas) == MULTIBYTE_TEXT == tokenizer.decode(token_ids)
    assert detok.flush() == ""


def test_incomplete_char_at_the_end_is_flushed(tokenizer: PreTrainedTokenizerFast) -> None:
    token_ids = tokenizer.encode("ok 中", add_special_tokens=False)[:-1]  # cut inside the last character
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(_stream(detok, token_ids))
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tokenizer.decode(token_ids)
    assert detok.output_text.endswith("\ufffd")


def test_special_tokens_skipped_or_kept(tokenizer: PreTrainedTokenizerFast) -> None:
    token_ids = tokenizer.encode("Hi there", add_special_tokens=False) + [tokenizer.eos_token_id]
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    _stream(kept, token_ids)
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    _stream(skipped, token_ids)
    assert kept.output_text == "Hi there</s>"
    assert skipped.output_text == "Hi there"


def test_leading_space_uses_prompt_context() -> None:
    # SentencePiece-style pieces: decode() drops the space of the text's first piece, so a token decoded alone
    # loses its space; with the prompt as context it must keep it.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert tokenizer.decode([2]) == "world"
    detok = IncrementalDetokenizer(tokenizer, [1])
    assert detok.add_tokens([2]) == " world"
    assert detok.add_tokens([3, 4]) == "! again"
    # Without context the first piece's space goes, exactly as in a full decode.
    alone = IncrementalDetokenizer(tokenizer, [])
    alone.add_tokens([2, 3, 4])
    assert alone.output_text == tokenizer.decode([2, 3, 4]) == "world! again"


def test_work_per_token_stays_bounded(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Once upon a time"))
    decoded_lengths = []
    inner = detok._decode
    detok._decode = lambda ids: decoded_lengths.append(len(ids)) or inner(ids)
    token_ids = tokenizer.encode("The cat was happy. " * 60, add_special_tokens=False)
    _stream(detok, token_ids)
    assert detok.output_text == "The cat was happy. " * 60
    assert max(decoded_lengths) <= 8  # a window of a few tokens, not the whole text


# ---------------------------------------------------------------------------------------------- stop strings


def test_stop_string_split_across_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    token_ids = tokenizer.encode("Hello world. The end", add_special_tokens=False)
    for include in (False, True):
        detok = IncrementalDetokenizer(tokenizer, [])
        hit = None
        for t in token_ids:
            before = len(detok.output_text)
            detok.add_tokens([t])
            hit = check_stop_strings(
                detok.output_text, len(detok.output_text) - before, ["o w", "xyz"], include
            )
            if hit:
                break
        assert hit is not None
        stop_str, truncate_to = hit
        assert stop_str == "o w"
        assert detok.output_text[:truncate_to] == ("Hello w" if include else "Hell")


def test_check_stop_strings_cases() -> None:
    # Found in the new tail only: "stop" lies wholly in old text here, so it is not reported again.
    assert check_stop_strings("a stop b", 2, ["stop"], False) is None
    assert check_stop_strings("a stop b", 4, ["stop"], False) == ("stop", 2)
    assert check_stop_strings("a stop b", 4, ["stop"], True) == ("stop", 6)
    # Earliest match wins, whatever the list order.
    assert check_stop_strings("xx AB CD", 6, ["CD", "AB"], False) == ("AB", 3)
    # A stop string at the very end with include: keep everything.
    assert check_stop_strings("abc\n\n", 1, ["\n\n"], True) == ("\n\n", 5)
    assert check_stop_strings("abc", 0, ["c"], False) is None
    assert check_stop_strings("abc", 3, [], False) is None
