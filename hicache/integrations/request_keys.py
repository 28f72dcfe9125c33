"""Page keys of an engine request whose KV depends on more than its token ids.

hicache's page key chains the namespace salt through every page's tokens
(hicache.index.keys). An engine request may carry inputs the tokens do not
show: a LoRA adapter or a cache salt change the KV of every page, and a
multimodal item (an image's placeholder tokens are all alike) changes the KV
of the pages its placeholders overlap and so, through the chain, every page
after them. Those go into the chain here:

- request-wide extras (adapter, cache salt) replace the salt the chain starts
  from with H(salt || extras), so such a request shares pages only with
  requests carrying the same extras;
- a page overlapping a multimodal item hashes the item's identifier after
  its tokens.

A request with neither gets exactly the keys of `page_keys`, so it shares
pages with every other engine of the namespace. Two prompts with equal token
ids but different images never share a page from the first image on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from hicache.index.keys import KEY_BYTES, as_tokens, page_keys


def _blob(parts: Iterable[str]) -> bytes:
    out = bytearray()
    for part in parts:
        data = part.encode()
        out += len(data).to_bytes(4, "little") + data  # length-prefixed: no ambiguity
    return bytes(out)


def chain_start(salt: bytes, extras: Sequence[str]) -> bytes:
    """The value page 0 chains from: the salt itself, or H(salt || extras)."""
    if not extras:
        return salt
    return hashlib.blake2b(salt + _blob(extras), digest_size=KEY_BYTES, person=b"hicache-req").digest()


def page_extras(items: Iterable[tuple[str, int, int]], page_size: int) -> dict[int, bytes]:
    """{page: what it must hash besides its tokens} for items (identifier, offset, length)
    laid over the token positions [offset, offset + length)."""
    per_page: dict[int, list[str]] = {}
    for ident, offset, length in items:
        if length <= 0:
            continue
        for page in range(offset // page_size, (offset + length - 1) // page_size + 1):
            per_page.setdefault(page, []).append(ident)
    return {p: _blob(v) for p, v in per_page.items()}


class RequestKeys:
    """The chained keys of one request's full pages, extended as its tokens grow."""

    __slots__ = ("salt", "start", "page_size", "extras", "keys", "token_bytes")

    def __init__(self, salt: bytes, page_size: int, *, extras: Sequence[str] = (),
                 items: Iterable[tuple[str, int, int]] = ()) -> None:
        self.salt = salt
        self.start = chain_start(salt, extras)
        self.page_size = page_size
        self.extras = page_extras(items, page_size)
        self.keys: list[bytes] = []
        self.token_bytes = bytearray()  # the hashed pages' tokens, packed int32 (what a put sends)

    def upto(self, tokens: Sequence[int] | np.ndarray, n_pages: int) -> list[bytes]:
        """Keys of the first n_pages pages of `tokens` (which must hold them all)."""
        ps = self.page_size
        have = len(self.keys)
        if n_pages > have:
            toks = as_tokens(np.asarray(tokens[have * ps:n_pages * ps]))
            if len(toks) < (n_pages - have) * ps:
                raise ValueError(f"{n_pages} pages need {n_pages * ps} tokens")
            self.token_bytes += toks.tobytes()
            page = have
            while page < n_pages:
                parent = self.keys[-1] if self.keys else self.start
                if page in self.extras:
                    chunk = toks[(page - have) * ps:(page - have + 1) * ps].tobytes()
                    self.keys.append(hashlib.blake2b(parent + chunk + self.extras[page],
                                                     digest_size=KEY_BYTES).digest())
                    page += 1
                    continue
                stop = min([p for p in self.extras if p > page] + [n_pages])  # the next page with extras
                self.keys += page_keys(self.salt, toks[(page - have) * ps:(stop - have) * ps], ps, parent=parent)
                page = stop
        return self.keys[:n_pages]
