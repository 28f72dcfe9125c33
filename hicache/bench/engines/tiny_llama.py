"""A tiny Llama with seeded random weights, saved as safetensors from a local config:
what the vLLM proof tests and `hicache bench vllm` run (no hub, no download).

`tokenizer=True` adds a word-level tokenizer with a chat template
(hicache/bench/engines/tiny_tokenizer.py), so the model can serve chat (`vllm serve`).

The weights are drawn wide (std 0.2) so that every output token depends on the KV:
with near-zero weights (vLLM's dummy loader) a wrong KV load can go unnoticed.
"""

from __future__ import annotations

import json
from pathlib import Path


def build_tiny_llama(path: str | Path, *, seed: int = 0, layers: int = 2, hidden: int = 128, heads: int = 4,
                     kv_heads: int = 2, vocab: int = 512, tokenizer: bool = False,
                     sliding_window: int | None = None) -> Path:
    """Write the model to `path` (kept if already there with the same settings); the
    weights do not depend on `tokenizer`. With `sliding_window`, even layers attend to that
    many tokens and odd layers to all (a hybrid model: vLLM gives the two kinds their own KV
    cache groups)."""
    path = Path(path)
    settings: dict[str, object] = {"seed": seed, "layers": layers, "hidden": hidden, "heads": heads,
                                   "kv_heads": kv_heads, "vocab": vocab}
    if tokenizer:  # only then: a stamp written before the option existed still matches
        settings["tokenizer"] = True
    window: dict = {}
    if sliding_window:
        settings["sliding_window"] = sliding_window
        window = {"sliding_window": sliding_window,
                  "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}
    stamp = path / "hicache-tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == settings:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, torch_dtype="float32", tie_word_embeddings=False, **window)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        from hicache.bench.engines.tiny_tokenizer import build_tiny_tokenizer

        build_tiny_tokenizer(path, vocab=vocab)
    stamp.write_text(json.dumps(settings))
    return path
