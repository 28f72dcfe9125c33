"""Where the Triton kernels can run, shared by every kernel module: Triton
installed, and a CUDA device or Triton's CPU interpreter (how the tests run
the kernels without a GPU). Nothing here imports Triton."""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """True when Triton would run kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def device_supported(device: torch.device) -> bool:
    """CUDA, or CPU under the interpreter: the devices a kernel can take tensors of."""
    return device.type == "cuda" or (device.type == "cpu" and interpreter_enabled())
