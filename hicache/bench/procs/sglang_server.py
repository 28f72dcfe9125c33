"""A real SGLang server process (`python -m sglang.launch_server`) for `hicache bench sglang-serve`
and the server tests: its command line, start (until /health answers), requests, stop.

On a CPU-only machine SGLang's kernel package has no CPU build on the registries:
`extra_path` goes first on the server's PYTHONPATH, for whatever stands in for it
(hicache's tests bring their own stand-ins; nothing here provides them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 600.0  # imports alone take a minute or more on two loaded cores


def hicache_extra_config(socket: str, **more: Any) -> str:
    """--hicache-storage-backend-extra-config for hicache (with --hicache-storage-backend dynamic)."""
    return json.dumps({"backend_name": "hicache", "module_path": "hicache.integrations.sglang",
                       "class_name": "HiCacheStore", "interface_v1": 1, "socket": socket, **more})


def server_args(model: str, port: int, socket: str | None, *, device: str = "cpu", max_total_tokens: int = 4096,
                hicache_ratio: float = 2.0, extra: dict[str, Any] | None = None) -> list[str]:
    """The command line of the server tests (docs/integrations/sglang.md shows it); socket None: no
    storage backend; `extra`: more keys of the backend's extra config."""
    args = ["--model-path", model, "--device", device, "--skip-tokenizer-init", "--page-size", "16",
            "--max-total-tokens", str(max_total_tokens), "--port", str(port), "--enable-hierarchical-cache",
            "--hicache-ratio", f"{hicache_ratio:g}", "--hicache-io-backend", "direct",
            "--hicache-mem-layout", "layer_first"]
    if socket is not None:
        args += ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                 hicache_extra_config(socket, **(extra or {}))]
    return args


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not hold within {timeout_s:g}s")
        time.sleep(1.0)


class SGLangServer:
    def __init__(self, args: list[str], port: int, log_path: Path, *, extra_path: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.args, self.port, self.log_path = args, port, log_path
        self.extra_path, self.env = extra_path or [], env or {}
        self.proc: subprocess.Popen | None = None

    def start(self) -> SGLangServer:
        env = dict(os.environ, **self.env)
        if "--device" in self.args and self.args[self.args.index("--device") + 1] == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"  # else SGLang's is_cpu() is False
        env["PYTHONPATH"] = os.pathsep.join([*self.extra_path, *filter(None, [env.get("PYTHONPATH")])])
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", *self.args], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait(self._ready, START_TIMEOUT_S, "the SGLang server answered /health")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"the SGLang server exited ({self.proc.returncode}):\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, n: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def post(self, path: str, body: dict | None = None, timeout_s: float = 300.0) -> Any:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return raw.decode(errors="replace")

    def generate(self, input_ids: list[int], max_new_tokens: int = 8) -> tuple[list[int], dict]:
        """Greedy output ids, and where the prompt's cached tokens came from (device/host/storage)."""
        r = self.post("/generate", {"input_ids": input_ids,
                                    "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}})
        meta = r["meta_info"]
        return r["output_ids"], dict(meta.get("cached_tokens_details") or {}, total=meta.get("cached_tokens", 0))

    def flush_cache(self) -> None:
        self.post("/flush_cache")

    def stop(self) -> None:
        if self.proc is None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:  # the scheduler and detokenizer processes too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
