"""A real `vllm serve` process for the tests: started in its own process group, awaited on
/health with a deadline, spoken to over its OpenAI HTTP API, killed as a group at the end.

Its log is kept as WORKDIR/NAME.log; a server that dies or never turns healthy raises
with the log's tail.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.daemon.disk_faults_util import free_port
from tests.wait import wait_until

log = logging.getLogger(__name__)

SERVED_NAME = "tiny"
CLI = Path(__file__).with_name("vllm_cli.py")


class VllmServer:
    """`vllm serve MODEL ARGS...` on 127.0.0.1; `env` is added to this process's environment.
    `entry` is the command before the listen flags and ARGS (vLLM's CLI, `serve MODEL`)."""

    def __init__(self, model: Path, workdir: Path, name: str, args: list[str], env: dict[str, str]) -> None:
        self.model, self.name, self.args, self.env = model, name, args, env
        self.log_path = workdir / f"{name}.log"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        # `vllm serve MODEL` (vLLM's CLI under this interpreter; see vllm_cli.py for the CPU build)
        self.entry = [sys.executable, str(CLI), "serve", str(model)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 480.0) -> VllmServer:
        cmd = [*self.entry, "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", SERVED_NAME,
               *self.args]
        log.info("starting %s: %s", self.name, " ".join(cmd))
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env}, start_new_session=True)
        try:
            wait_until(self._healthy, timeout_s, f"{self.name} answering /health", interval_s=0.5)
        except TimeoutError as e:
            raise RuntimeError(f"{e}:\n{self.log_tail()}") from None
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group (the API server and its engine core), SIGKILL what stays."""
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self._group_gone_after(sig, timeout_s):
                break
        self.proc = None

    def _group_gone_after(self, sig: signal.Signals, timeout_s: float) -> bool:
        assert self.proc is not None
        pgid = self.proc.pid  # start_new_session: the group's id is the leader's pid
        deadline = time.monotonic() + timeout_s
        try:
            os.killpg(pgid, sig)
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the leader, or the group never looks empty
                os.killpg(pgid, 0)
                time.sleep(0.1)
        except ProcessLookupError:
            return True
        return False

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    # -- HTTP ------------------------------------------------------------------------------------
    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float = 120.0) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.name} {path}: HTTP {e.code} {e.read()[:2000]!r}") from e

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        return self.post("/v1/chat/completions", {"model": SERVED_NAME, "messages": messages,
                                                  "temperature": 0.0, "max_tokens": max_tokens})

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> None:
        """Clear vLLM's own prefix cache (not the connector's). vLLM refuses while blocks are
        held, e.g. by a finished request whose saves to hicache are still running: retry."""
        wait_until(lambda: self.post("/reset_prefix_cache")["success"], timeout_s,
                   f"{self.name} resetting its prefix cache", interval_s=0.05)

    def counters(self) -> dict[str, float]:
        """vLLM's Prometheus counters (summed over label sets), by sample name (`..._total`)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.type != "counter":
                continue
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.name] = out.get(s.name, 0.0) + s.value
        return out

