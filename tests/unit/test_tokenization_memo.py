"""The tokenization memo gives exactly the tokens a fresh tokenization gives, for every kind of tokenizer.

Real fast tokenizers of the two families people have (GPT-2 style byte-level
BPE, SentencePiece style Metaspace with a prepended word marker), trained here
on a small corpus, each with ChatML special tokens; texts that reuse earlier
ones the way a prefix cache's traffic does (repeats, next turns, edits,
special tokens next to spaces and newlines), and random mutations of them.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from prefixd.daemon.models.tokenization_memo import MAX_ENTRIES, TokenizationMemo

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CORPUS = [
    "def main():\n    return 0\n", "The capital of France is Paris.", "  leading spaces and\ttabs\n\n",
    "user assistant system question answer", "héllo wörld — ünïcode ✓ 東京", "x = [1, 2, 3]  # a list",
] * 20


def byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def metaspace_unigram() -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False, unk_token="<|endoftext|>")
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def stripping_specials() -> Tokenizer:
    """Byte-level BPE whose special tokens swallow the spaces around them (lstrip/rstrip)."""
    tok = byte_level_bpe()
    tok.add_special_tokens([AddedToken("<|tool|>", lstrip=True, rstrip=True, special=True)])
    return tok


def chatml(messages: list[tuple[str, str]], generation_prompt: bool = True) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def memo_for(tok: Tokenizer) -> TokenizationMemo:
    special = {i: added.content for i, added in tok.get_added_tokens_decoder().items() if added.special}

    def tokenize(text: str):
        enc = tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [s for s, _ in enc.offsets], [e for _, e in enc.offsets]

    return TokenizationMemo(tokenize, special)


def fresh(tok: Tokenizer, text: str) -> tuple[list[int], list[int]]:
    enc = tok.encode(text, add_special_tokens=False)
    return list(enc.ids), [e for _, e in enc.offsets]


def traffic() -> list[str]:
    """Texts in the order a daemon sees them: a chat growing turn by turn, repeats, edits, other questions."""
    system = "You are a helpful assistant.\n" + "def main():\n    return 0\n" * 8
    chat = [("system", system)]
    texts = []
    for turn in range(5):
        chat.append(("user", f"question {turn}: what does main return?  "))
        texts.append(chatml(chat))
        texts.append(chatml(chat))  # an exact repeat
        chat.append(("assistant", f" It returns 0 ({turn}).\n"))
    texts.append(chatml(chat[:2] + [("user", "another question on the same system prompt")]))
    texts.append(chatml([("system", system.replace("return 0", "return 1", 1))] + chat[1:]))  # an edit early on
    texts.append(chatml(chat, generation_prompt=False) + "<|im_start|>user\n<|tool|> call  <|tool|>x<|im_end|>\n")
    texts.append(chatml(chat) + "  trailing spaces after the special token")
    texts.append("<|im_start|><|im_end|><|im_start|>")  # specials only
    texts.append("héllo wörld — ünïcode ✓ 東京<|im_end|>東京 ✓")
    return texts


@pytest.mark.parametrize("make", [byte_level_bpe, metaspace_unigram, stripping_specials])
def test_memo_equals_fresh_tokenization(make):
    tok = make()
    memo = memo_for(tok)
    for text in traffic():
        assert memo.encode(text) == fresh(tok, text), text
    assert memo.reused_tokens > 0  # the memo was used, not only filled


@pytest.mark.parametrize("make", [byte_level_bpe, metaspace_unigram, stripping_specials])
def test_memo_equals_fresh_tokenization_under_random_edits(make):
    tok = make()
    memo = memo_for(tok)
    rng = random.Random(7)
    pieces = SPECIALS + ["<|tool|>", " ", "\n", "  ", "a", "return", "▁", "é", "東", "<|im", "|>", "end"]
    texts = traffic()
    for _ in range(300):
        base = rng.choice(texts)
        cut = rng.randrange(len(base) + 1)
        text = base[:cut] + "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 6))) + base[cut:][: rng.randrange(200)]
        texts.append(text)
        assert memo.encode(text) == fresh(tok, text), repr(text)


def test_memo_keeps_only_recent_texts():
    tok = byte_level_bpe()
    memo = memo_for(tok)
    for i in range(MAX_ENTRIES + 5):
        memo.encode(chatml([("user", f"message number {i}")]))
    assert len(memo._entries) == MAX_ENTRIES


def test_an_answer_extended_in_is_given_back_with_the_tokens_the_model_chose():
    tok = byte_level_bpe()
    memo = memo_for(tok)
    prompt = chatml([("user", "what does main return?")])
    prompt_ids, _ = memo.encode(prompt)
    answer = "def main():\n    return 0\n"
    # one token per character: a split the tokenizer itself would never make, as a sampled answer can be
    answer_ids = [tok.encode(c, add_special_tokens=False).ids[0] for c in answer] + [tok.token_to_id("<|im_end|>")]
    assert answer_ids[:-1] != fresh(tok, answer)[0]
    assert memo.extend(prompt, answer + "<|im_end|>", answer_ids, list(range(len(answer) + 1)),
                       list(range(1, len(answer) + 1)) + [len(answer) + len("<|im_end|>")])
    next_turn = prompt + answer + "<|im_end|>\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n"
    ids, _ = memo.encode(next_turn)
    assert ids[:len(prompt_ids) + len(answer)] == prompt_ids + answer_ids[:-1]
    assert ids[len(prompt_ids) + len(answer):] == fresh(tok, next_turn[len(prompt) + len(answer):])[0]
    assert not memo.extend("a text never encoded", "x", [1], [0], [1])  # nothing to extend: refused


def test_an_answer_ended_by_a_grammar_is_kept_whole_where_the_template_closes_it_with_a_special_token():
    tok = byte_level_bpe()
    memo = memo_for(tok)
    prompt = chatml([("user", "call a tool")])
    prompt_ids, _ = memo.encode(prompt)
    answer = '<tool_call>\n{"name": "main"}\n</tool_call>'  # a forced call as text: no special token ends it
    answer_ids = [tok.encode(c, add_special_tokens=False).ids[0] for c in answer]
    assert answer_ids != fresh(tok, answer)[0]
    assert memo.extend(prompt, answer, answer_ids, list(range(len(answer))), list(range(1, len(answer) + 1)))
    next_turn = prompt + answer + "<|im_end|>\n<|im_start|>user\nit returned 0<|im_end|>\n<|im_start|>assistant\n"
    ids, _ = memo.encode(next_turn)
    assert ids[:len(prompt_ids) + len(answer_ids)] == prompt_ids + answer_ids
    assert ids[len(prompt_ids) + len(answer_ids):] == fresh(tok, next_turn[len(prompt) + len(answer):])[0]
    went_on = prompt + answer + " and more text<|im_end|>\n"  # no special token right after the answer: no cut there
    assert memo.encode(went_on) == fresh(tok, went_on)
