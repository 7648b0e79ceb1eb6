"""A raw text prompt is encoded exactly as the tokenizer's own ``encode`` does, and a repeat is not tokenized again.

Real fast tokenizers (trained here, as in test_tokenization_memo.py), wrapped
the way a loaded model's are (transformers, then mlx-lm's TokenizerWrapper),
with the framings tokenizers have: none, a BOS, a BOS and an EOS.
"""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import Tokenizer, processors
from transformers import PreTrainedTokenizerFast

from prefixd.daemon.models.prompt_encoding import PromptEncoder
from prefixd.protocol.methods import PromptInput
from tests.unit.test_tokenization_memo import byte_level_bpe, metaspace_unigram, traffic

FRAMES = {
    "none": None,
    "bos": ("<|endoftext|> $A", []),
    "bos-eos": ("<|im_start|> $A <|im_end|>", []),
}


def encoder_for(make, frame: str) -> tuple[PromptEncoder, PreTrainedTokenizerFast]:
    tok: Tokenizer = make()
    if FRAMES[frame] is not None:
        single, _ = FRAMES[frame]
        specials = [(name, tok.token_to_id(name)) for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    return PromptEncoder(TokenizerWrapper(hf), "test", 1 << 20), hf


def raw_texts() -> list[str]:
    fim = "<|im_start|>def add(a, b):\n    <|im_end|>\n    return a + b\n<|im_start|>"
    return [*traffic(), fim, fim + "x", " leading space", "", "東京 ✓", *traffic()]


@pytest.mark.parametrize("frame", FRAMES)
@pytest.mark.parametrize("make", [byte_level_bpe, metaspace_unigram])
def test_a_raw_prompt_gets_the_tokenizers_own_ids(make, frame):
    encoder, hf = encoder_for(make, frame)
    for text in raw_texts():
        assert encoder.encode(PromptInput(text=text), generates=None).tokens == hf.encode(text), repr(text)


@pytest.mark.parametrize("frame", FRAMES)
def test_a_repeated_raw_prompt_takes_its_tokens_from_the_memo(frame):
    encoder, hf = encoder_for(byte_level_bpe, frame)
    assert encoder._raw_frame is not None
    text = "<|im_start|>" + "def main():\n    return 0\n" * 200 + "<|im_end|>"
    first = encoder.encode(PromptInput(text=text), generates=None).tokens
    before = encoder._memo.reused_tokens
    again = encoder.encode(PromptInput(text=text), generates=None).tokens
    assert again == first == hf.encode(text)
    assert encoder._memo.reused_tokens - before == len(first) - len(encoder._raw_frame[0]) - len(encoder._raw_frame[1])


def test_a_framing_that_is_not_a_head_and_a_tail_tokenizes_every_raw_prompt_whole():
    tok = byte_level_bpe()
    start = tok.token_to_id("<|im_start|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|im_start|> $A", special_tokens=[("<|im_start|>", start)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    encoder = PromptEncoder(TokenizerWrapper(hf), "test", 1 << 20)
    assert encoder._raw_frame is None
    for text in raw_texts()[:6]:
        assert encoder.encode(PromptInput(text=text), generates=None).tokens == hf.encode(text)
