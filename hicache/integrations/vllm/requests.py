"""A vLLM request as the connector's scheduler side sees it: its state, and what its KV depends on.

`RequestState` is shared by scheduler.py (which creates and drops it) and saves.py (which
reserves its pages); `request_extras` and `request_hint` read what vLLM's Request carries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from hicache.client.hints import RetainHint
from hicache.integrations.request_keys import RequestKeys
from hicache.integrations.vllm.lookups import Lookup

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class RequestState:
    """What the scheduler side keeps of one vLLM request: its keys, blocks, load and saves."""

    request: Any  # vllm Request: all_token_ids grows as it decodes
    keys: dict[int, RequestKeys]  # per namespace rank (salts differ)
    blocks: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved_pages: int = 0  # leading pages offered to the host tier (stored, or being stored)
    save_retries: int = 0  # steps a save waited for the pages before a window-freed block to be stored
    lookup: Lookup | None = None  # while vLLM has not scheduled it; then the pins of its load
    pinned_at: float = 0.0
    load: tuple[int, int] | None = None  # pages [start, end) the workers load this step
    asking: int = 0  # puts sent, not answered
    puts: int = 0  # puts answered whose copies are not reported
    finished: bool = False  # vLLM finished it; kept while its saves run
    announced: bool = False  # told the workers it waits for its saves (metadata `delayed`)
    load_failed: bool = False  # an async load failed: vLLM recomputes it, we offer it nothing more
    hint: RetainHint | None = None  # kv_transfer_params {"hicache": {...}}: pin or prioritize the prompt once stored


def request_extras(request: Any) -> tuple[list[str], list[tuple[str, int, int]]] | None:
    """What the request's KV depends on besides its token ids (see request_keys.py);
    None when it cannot be keyed at all (prompt embeddings)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    extras = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extras.append(f"lora={lora.lora_name}/{getattr(lora, 'lora_int_id', '')}/{getattr(lora, 'lora_path', '')}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        extras.append(f"cache_salt={salt}")
    items = [(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
             for f in (getattr(request, "mm_features", None) or [])]
    return extras, items


def request_hint(request: Any) -> RetainHint | None:
    """The retention hint a request carries in kv_transfer_params (vLLM fills them from
    SamplingParams.extra_args["kv_transfer_params"]); a malformed one is logged and
    ignored: a cache hint never fails a request."""
    try:
        return RetainHint.from_transfer_params(getattr(request, "kv_transfer_params", None))
    except ValueError as e:
        log.warning("request %s: hicache hint ignored: %s", getattr(request, "request_id", "?"), e)
        return None
