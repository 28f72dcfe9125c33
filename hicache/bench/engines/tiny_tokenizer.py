"""A word-level tokenizer for the tiny Llama, built locally (no hub): what lets the
tiny model serve chat over vLLM's OpenAI API.

Its vocabulary is exactly the model's: a few special tokens, then the words
`w0`, `w1`, ... split on whitespace. A text of these words decodes and re-encodes to
the same ids, so a conversation resent with the assistant's replies keeps the token
prefix of the turn before (what a prefix cache needs), and every id the random model
can emit decodes to something.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
# ids 1 and 2 are LlamaConfig's default bos / eos, which the model's generation config names
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def word(i: int) -> str:
    """The i-th ordinary word of the vocabulary (token id i + len(SPECIAL_TOKENS))."""
    return f"w{i}"


def build_tiny_tokenizer(path: str | Path, *, vocab: int) -> Path:
    """Write tokenizer.json, tokenizer_config.json and the chat template to `path`."""
    if vocab <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab}")
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL_TOKENS + [word(i) for i in range(vocab - len(SPECIAL_TOKENS))]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by single spaces
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    path = Path(path)
    fast.save_pretrained(path)
    return path
