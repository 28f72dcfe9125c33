"""The tiny model's tokenizer: what `vllm serve`'s chat relies on, checked without vLLM."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from hicache.bench.engines.tiny_llama import build_tiny_llama
from hicache.bench.engines.tiny_tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer, word


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab=64))


def test_vocabulary_is_the_models(tokenizer):
    assert len(tokenizer) == 64
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)  # LlamaConfig's defaults
    assert tokenizer.convert_ids_to_tokens(len(SPECIAL_TOKENS)) == word(0)
    # every id decodes to something: the random model may emit any of them
    assert all(tokenizer.decode([i], skip_special_tokens=True) for i in range(len(SPECIAL_TOKENS), 64))


def test_replies_re_encode_to_the_same_ids(tokenizer):
    ids = [7, 30, 6, 63, 12]
    assert tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] == ids
    assert tokenizer(" " + tokenizer.decode(ids), add_special_tokens=False)["input_ids"] == ids


def test_a_turn_extends_the_previous_prompt(tokenizer):
    """Resending the conversation keeps the earlier prompt's tokens as a prefix (what a
    prefix cache hits)."""
    turn1 = [{"role": "system", "content": "w1 w2 w3"}, {"role": "user", "content": "w4 w5"}]
    turn2 = [*turn1, {"role": "assistant", "content": " w6 w7"}, {"role": "user", "content": "w8"}]
    first, second = (tokenizer.apply_chat_template(t, tokenize=False, add_generation_prompt=True)
                     for t in (turn1, turn2))
    a = tokenizer(first, add_special_tokens=False)["input_ids"]
    b = tokenizer(second, add_special_tokens=False)["input_ids"]
    assert a == [3, 7, 8, 9, 4, 10, 11, 5]  # <|system|> w1 w2 w3 <|user|> w4 w5 <|assistant|>
    assert b[:len(a)] == a and len(b) > len(a)


def test_too_small_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="special tokens"):
        build_tiny_tokenizer(tmp_path, vocab=len(SPECIAL_TOKENS))
    assert not any(tmp_path.iterdir())


def test_model_with_tokenizer_keeps_the_weights(tmp_path):
    plain = build_tiny_llama(tmp_path / "plain", layers=1, hidden=32, heads=2, kv_heads=1, vocab=64)
    chat = build_tiny_llama(tmp_path / "chat", layers=1, hidden=32, heads=2, kv_heads=1, vocab=64, tokenizer=True)
    assert (plain / "model.safetensors").read_bytes() == (chat / "model.safetensors").read_bytes()
    assert not (plain / "tokenizer.json").exists()
    assert json.loads((plain / "hicache-tiny.json").read_text())["vocab"] == 64
    assert len(AutoTokenizer.from_pretrained(chat)) == 64
