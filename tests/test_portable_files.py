"""Export / import files against hostile file systems and damaged sizes: real CLI, real daemons.

- export writes FILE.part (created 0600, never through a link) and renames it over FILE;
  a link or anything else planted at either name is refused and left as it was;
- import reads only a regular file, and checks every size a record declares against the
  header, the file and the daemon's limits before reading the record.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import xxhash

from hicache.client.connection import RpcConnection
from hicache.errors import ClientError
from hicache.index.keys import Namespace, page_keys
from hicache.layout import KVLayout
from hicache.portable.format import PAGE_HEAD, TAG_PAGE, XXH3, ExportHeader, decode_header, encode_page
from tests.conftest import DaemonProcess
from tests.daemon.engine_worker import LAYOUTS, tokens_for
from tests.daemon.test_cycle import run_worker
from tests.test_cli_admin import call, cli, split_file, wait_disk

PAGES = 10  # store:1:42 -> 10 full pages
VICTIM = b"precious bytes that no export may touch\n"
SPARSE_BYTES = 512 << 20


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    """Daemon A with PAGES pages of namespace test-model on disk; daemon B empty (import target)."""
    base = tmp_path_factory.mktemp("portable")
    a = DaemonProcess(base / "a", "--host-capacity", "64MiB", "--disk-capacity", "256MiB").start()
    b = DaemonProcess(base / "b", "--host-capacity", "64MiB", "--disk-capacity", "256MiB").start()
    try:
        run_worker(a.socket, "store:1:42")
        wait_disk(a, PAGES)
        yield a, b, Namespace("test-model", LAYOUTS["mha"]).salt().hex()
    finally:
        a.stop(signal.SIGKILL)
        b.stop(signal.SIGKILL)


def one_line_error(out: subprocess.CompletedProcess, *expected: str) -> str:
    assert out.returncode == 1 and out.stdout == "", (out.returncode, out.stdout, out.stderr)
    message = out.stderr.strip()
    assert len(message.splitlines()) == 1 and message.startswith("hicache: "), message
    for part in expected:
        assert part in message, message
    return message


def export(a: DaemonProcess, salt: str, path: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hicache.cli", "export", "--socket", a.socket, "--namespace",
                           salt[:12], str(path)], capture_output=True, text=True, timeout=120, **kw)


def b_is_empty(b: DaemonProcess) -> None:
    st = call(b, "stats")
    assert st["namespaces"] == 0 and st["tiers"]["disk"]["pages"] == 0


# -- export: links and leftovers at FILE.part and FILE (#7), private files (#10) ------------------

@pytest.mark.parametrize("kind", ["link to a file", "dangling link"])
def test_export_never_writes_through_a_link_planted_at_the_part_name(tmp_path, daemons, kind):
    a, _, salt = daemons
    victim = tmp_path / "victim"
    if kind == "link to a file":
        victim.write_bytes(VICTIM)
    out = tmp_path / "ns.hicache"
    part = tmp_path / "ns.hicache.part"
    part.symlink_to(victim)
    one_line_error(export(a, salt, out), str(part), "already exists")
    assert part.is_symlink() and os.readlink(part) == str(victim)  # not ours: left alone
    if kind == "link to a file":
        assert victim.read_bytes() == VICTIM
    else:
        assert not victim.exists()  # the link did not make us create a file where it points
    assert not out.exists() and not out.is_symlink()


@pytest.mark.parametrize("kind", ["link to a file", "fifo"])
def test_export_refuses_a_final_name_that_is_not_its_own_regular_file(tmp_path, daemons, kind):
    a, _, salt = daemons
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    out = tmp_path / "ns.hicache"
    if kind == "fifo":
        os.mkfifo(out)
    else:
        out.symlink_to(victim)
    one_line_error(export(a, salt, out), str(out), "refusing to replace it")
    assert victim.read_bytes() == VICTIM
    if kind == "fifo":
        assert stat.S_ISFIFO(out.lstat().st_mode)
    else:
        assert out.is_symlink() and os.readlink(out) == str(victim)
    assert not (tmp_path / "ns.hicache.part").exists()


def test_a_leftover_part_file_is_refused_and_kept(tmp_path, daemons):
    a, _, salt = daemons
    out = tmp_path / "ns.hicache"
    part = tmp_path / "ns.hicache.part"
    part.write_bytes(b"half an export from a crashed run")
    one_line_error(export(a, salt, out), str(part), "already exists", "remove it")
    assert part.read_bytes() == b"half an export from a crashed run" and not out.exists()
    part.unlink()
    assert export(a, salt, out).returncode == 0
    assert len(split_file(out.read_bytes())[1]) == PAGES + 1


def test_export_files_are_private_and_replace_our_own_earlier_export(tmp_path, daemons):
    a, _, salt = daemons
    out = tmp_path / "ns.hicache"
    out.write_bytes(b"an older export of ours")
    done = export(a, salt, out, umask=0)  # even with no umask at all
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600 and stat.S_ISREG(out.lstat().st_mode)
    header, records = split_file(out.read_bytes())
    assert decode_header(header).salt.hex() == salt and len(records) == PAGES + 1
    assert not (tmp_path / "ns.hicache.part").exists()


# -- import: only regular files (#7), sizes checked before reading (#9) ---------------------------

@pytest.mark.parametrize("kind", ["fifo", "link to a fifo", "/dev/zero"])
def test_import_reads_only_a_regular_file(tmp_path, daemons, kind):
    _, b, _ = daemons
    path = tmp_path / "in.hicache"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to a fifo":
        os.mkfifo(tmp_path / "fifo")
        path.symlink_to(tmp_path / "fifo")
    else:
        path = Path("/dev/zero")
    # without the check a fifo with no writer blocks the CLI for ever: the timeout is a hang guard
    out = cli("import", "--socket", b.socket, str(path), timeout_s=60)
    one_line_error(out, str(path), "not a regular file")
    b_is_empty(b)


def run_measured(*args: str, timeout_s: float = 120) -> tuple[subprocess.CompletedProcess, int]:
    """Run the CLI; its result and its own peak RSS in bytes (wait4 on it alone, not on every child)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "hicache.cli", *args], stdout=out, stderr=err)
        deadline = time.monotonic() + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                raise TimeoutError(f"hicache {' '.join(args)} still running after {timeout_s}s")
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out.read().decode(), err.read().decode())
    return result, usage.ru_maxrss * 1024


def sparse_file(path: Path, header: ExportHeader, n_tokens: int, page_len: int) -> Path:
    """A header, then one page record head declaring these sizes, then zeros (a hole) up to SPARSE_BYTES."""
    with open(path, "wb") as f:
        f.write(header.encode() + PAGE_HEAD.pack(TAG_PAGE, bytes(16), bytes(16), 0, n_tokens, page_len))
    os.truncate(path, SPARSE_BYTES)
    return path


HUGE_LAYOUT = KVLayout("mha", num_layers=2048, page_size=64, num_kv_heads=8, head_dim=128)  # 512 MiB pages


@pytest.mark.parametrize("record", ["page_len 4 GiB", "n_tokens 4G", "huge pages in the header"])
def test_import_checks_declared_sizes_before_reading(tmp_path, daemons, record):
    _, b, _ = daemons
    test_model = ExportHeader.for_namespace(Namespace("test-model", LAYOUTS["mha"]))
    # the same CLI path on a small file refused at its first record: the RSS baseline
    small = tmp_path / "small.hicache"
    small.write_bytes(test_model.encode() + b"X" + bytes(100))
    base_out, base_rss = run_measured("import", "--socket", b.socket, str(small))
    one_line_error(base_out, "unknown record tag")

    if record == "page_len 4 GiB":
        path = sparse_file(tmp_path / "big.hicache", test_model, 4, 2**32 - 1)
        expected = ("record 1", "4294967295 bytes", "768 bytes")
    elif record == "n_tokens 4G":
        path = sparse_file(tmp_path / "big.hicache", test_model, 2**32 - 1, 768)
        expected = ("record 1", "4294967295 tokens")
    else:
        huge = ExportHeader.for_namespace(Namespace("huge", HUGE_LAYOUT))
        path = sparse_file(tmp_path / "big.hicache", huge, HUGE_LAYOUT.page_size, HUGE_LAYOUT.page_bytes)
        expected = ("need host slabs of twice that",)
    assert path.stat().st_size == SPARSE_BYTES and path.stat().st_blocks * 512 < 1 << 20  # a hole, not data
    out, rss = run_measured("import", "--socket", b.socket, str(path))
    # reading the declared record costs SPARSE_BYTES (512 MiB) and more; the check costs nothing
    # (a generous bound: RSS noise between two runs of the same CLI is a few MiB)
    assert rss < base_rss + (96 << 20), (rss >> 20, base_rss >> 20)
    one_line_error(out, *expected)
    b_is_empty(b)


def test_the_daemon_refuses_a_chunk_with_a_damaged_record_size(daemons):
    """Straight to the daemon: sizes are checked against the header before the record is summed."""
    _, b, _ = daemons
    header = ExportHeader.for_namespace(Namespace("test-model", LAYOUTS["mha"]))
    tokens = tokens_for(5, 4)
    (key,) = page_keys(header.salt, tokens, 4)
    good = encode_page(key, None, tokens.tobytes(), bytes(header.page_bytes))

    def resized(n_tokens: int, page_len: int, body: bytes) -> bytes:
        head = PAGE_HEAD.pack(TAG_PAGE, key, bytes(16), 0, n_tokens, page_len)
        return head + body + XXH3.pack(xxhash.xxh3_64_intdigest(head + body))

    bad_chunks = {
        "declares 4 GiB": good[:PAGE_HEAD.size - 4] + (2**32 - 1).to_bytes(4, "little") + good[PAGE_HEAD.size:],
        "declares 4G tokens": resized(2**32 - 1, 768, good[PAGE_HEAD.size:-XXH3.size]),
        "a self-consistent record of twice the page": resized(4, 1536, tokens.tobytes() + bytes(1536)),
        "a self-consistent record of no tokens": resized(0, 768, bytes(768)),
    }
    conn = RpcConnection.connect(b.socket, timeout_s=30)
    try:
        conn.hello()
        imp = conn.call("import_open", {"header": header.encode()})["import"]
        for name, chunk in bad_chunks.items():
            with pytest.raises(ClientError, match="record 1: ") as err:
                conn.call("import_pages", {"import": imp, "data": chunk})
            assert err.value.code == "BAD_PARAMS", name
            assert "\n" not in str(err.value)
            b_is_empty(b)
    finally:
        conn.close()
