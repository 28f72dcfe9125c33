"""The admin CLI against real daemon processes: stats, ls, evict, flush, doctor, export / import."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from hicache.cli.doctor import daemon_checks
from hicache.client.connection import RpcConnection
from hicache.errors import ClientError
from hicache.index.keys import Namespace, page_keys
from hicache.layout import KVLayout
from hicache.portable.format import (
    CRC, FILE_HEAD, XXH3, ExportHeader, decode_header, encode_end, encode_page, head_size, header_length,
    record_rest,
)
from tests.conftest import DaemonProcess
from tests.daemon.engine_worker import LAYOUTS, tokens_for
from tests.daemon.test_cycle import run_worker
from tests.pty_run import run_on_pty

# Conversations stored on daemon A: one alone, two sharing a 6-page prefix (a branch), one more root.
STORED = {"1:42": 10, "4:40:24": 10, "5:48:24": 12, "3:24": 6}
DISK_PAGES = 10 + 6 + 4 + 6 + 6  # the shared prefix once


def cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hicache.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def cli_json(*args: str) -> dict:
    out = cli(*args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def call(daemon: DaemonProcess, method: str, params: dict | None = None):
    conn = RpcConnection.connect(daemon.socket, timeout_s=30)
    try:
        conn.hello()
        return conn.call(method, params)
    finally:
        conn.close()


def wait_disk(daemon: DaemonProcess, pages: int) -> None:
    """Until write-through has committed `pages` pages (a hang guard, not a timing check)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        disk = call(daemon, "stats")["tiers"]["disk"]
        if disk["pages"] >= pages and disk["queue_depth"] == 0:
            return
        time.sleep(0.05)
    raise TimeoutError(f"disk tier holds {disk['pages']} pages, expected {pages}")


@pytest.fixture
def start(tmp_path):
    """start(name, *serve args, env=...) -> a running daemon under tmp_path/name, killed afterwards."""
    started: list[DaemonProcess] = []

    def make(name: str, *args: str, env: dict | None = None) -> DaemonProcess:
        (tmp_path / name).mkdir()
        d = DaemonProcess(tmp_path / name, *args, env=env)
        started.append(d)
        return d.start()

    yield make
    for d in started:
        d.stop(signal.SIGKILL)


def split_file(data: bytes) -> tuple[bytes, list[bytes]]:
    """An export file as (header, [record bytes ...]) using the format's own framing."""
    n = header_length(data[:FILE_HEAD.size])
    records, pos = [], n
    while pos < len(data):
        head = head_size(data[pos:pos + 1])
        size = head + record_rest(data[pos:pos + head])
        records.append(data[pos:pos + size])
        pos += size
    return data[:n], records


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Daemon A with engine-computed pages on disk, and its export of namespace test-model."""
    base = tmp_path_factory.mktemp("a")
    a = DaemonProcess(base, "--host-capacity", "64MiB", "--disk-capacity", "256MiB").start()
    try:
        run_worker(a.socket, *(f"store:{op}" for op in STORED))
        run_worker(a.socket, "store:9:16", extra_key="tenant-b")  # a second namespace of the same model
        wait_disk(a, DISK_PAGES + 4)
        salt = Namespace("test-model", LAYOUTS["mha"]).salt().hex()
        path = base / "test-model.hicache"
        # small chunks: parents arrive in earlier chunks than their children
        out = cli_json("export", "--socket", a.socket, "--namespace", salt[:12], "--chunk-bytes", "2KiB", str(path))
        assert out["pages"] == DISK_PAGES and out["skipped_pages"] == 0
        assert not Path(str(path) + ".part").exists()
        yield a, path, salt
    finally:
        a.stop()


# -- stats / ls / evict / flush ----------------------------------------------------------------

def test_stats_ls_evict_flush(tmp_path, start):
    d = start("d", "--host-capacity", "64MiB", "--no-disk")
    run_worker(d.socket, "store:1:42", "store:3:24")
    s = d.socket
    st = cli_json("stats", "--socket", s)
    assert st["pid"] == d.proc.pid and st["engines"] == []  # the engine process has exited
    assert st["tiers"]["host"]["pages"] == 16 and st["requests"]["inserted_pages"] == 16
    assert "disk" not in st["tiers"]

    tree = cli_json("ls", "--socket", s)
    (ns,) = tree["namespaces"]
    assert ns["model"] == "test-model" and ns["pages"]["host"] == 16 and ns["layout"] == LAYOUTS["mha"].to_dict()
    assert sorted(n["pages"] for n in ns["tree"]) == [6, 10]

    page = LAYOUTS["mha"].page_bytes
    ev = cli_json("evict", "--socket", s, "--tier", "host", "--bytes", str(page))
    assert ev["bytes"] >= page  # whole nodes go: the LRU leaf
    left = cli_json("stats", "--socket", s)["tiers"]["host"]["pages"]
    assert left == 16 - ev["bytes"] // page and left in (6, 10)

    text = cli("flush", "--socket", s, "--tier", "host")
    assert text.returncode == 0 and text.stdout.strip() == f"flushed {left} pages from host"
    assert cli_json("stats", "--socket", s)["tiers"]["host"]["pages"] == 0
    assert cli_json("ls", "--socket", s)["namespaces"][0]["pages"]["host"] == 0


def test_evict_refuses_a_bad_size(tmp_path, start):
    d = start("d", "--host-capacity", "64MiB", "--no-disk")
    out = cli("evict", "--socket", d.socket, "--tier", "host", "--bytes", "lots")
    assert out.returncode == 1 and out.stderr.strip() == "hicache: not a size: 'lots' (use e.g. 512MiB, 4GiB, 1073741824)"


@pytest.mark.parametrize("command", [
    ["stats"], ["stats", "--json"], ["ls"], ["evict", "--tier", "disk", "--bytes", "1MiB"], ["flush", "--tier", "host"],
    ["doctor"], ["doctor", "--json"], ["export", "--namespace", "x", "OUT"], ["import", "IN"],
])
def test_no_daemon_is_one_line_and_exit_2(tmp_path, command):
    valid = tmp_path / "valid.hicache"
    header = ExportHeader.for_namespace(Namespace("m", LAYOUTS["mha"]))
    valid.write_bytes(header.encode() + encode_end(0, 0))  # import checks the file before connecting
    args = [str(valid) if a == "IN" else str(tmp_path / "out") if a == "OUT" else a for a in command]
    out = cli(*args, "--socket", str(tmp_path / "none.sock"))
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hicache: the daemon is not running or not reachable")
    assert "none.sock" in lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.part").exists()


# -- doctor --------------------------------------------------------------------------------

def test_doctor_on_a_running_daemon(tmp_path, start):
    d = start("d", "--host-capacity", "64MiB", "--disk-capacity", "256MiB")
    run_worker(d.socket, "store:1:42")
    wait_disk(d, 10)
    out = cli("doctor", "--socket", d.socket, "--json")
    report = json.loads(out.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["socket", "daemon", "memlock", "arena", "shm", "overcommit", "lmdb", "lmdb readers",
                            "last write", "state dir", "free disk", "native index", "native frame loop",
                            "native disk writer", "native copy"]
    # the build the tests run has every native path: none warns
    assert all(checks[f"native {p}"]["status"] == "ok" for p in ("index", "frame loop", "disk writer", "copy"))
    assert all(c["status"] in ("ok", "warn", "fail") and "\n" not in c["detail"] for c in checks.values())
    assert out.returncode == (1 if report["failures"] else 0)
    assert report["daemon"]["pid"] == d.proc.pid
    assert checks["socket"]["status"] == "ok" and "mode 0660" in checks["socket"]["detail"]
    assert checks["arena"]["status"] == "ok"
    assert checks["lmdb"]["detail"].startswith("10 pages, 7.5KiB of 256.0MiB")
    assert report["daemon"]["disk"]["pages"] == 10 and report["daemon"]["disk"]["max_readers"] > 0
    # the state directory's real size: the LMDB file, allocated whole, is the disk capacity
    usage = report["daemon"]["state_usage"]
    data = Path(d.state_dir) / "disk" / "data.mdb"
    assert data.stat().st_size == 256 << 20 and data.stat().st_blocks * 512 >= 256 << 20
    assert 256 << 20 <= usage["allocated_bytes"] <= (256 << 20) + (1 << 20) and usage["disk_capacity"] == 256 << 20
    assert checks["state dir"]["status"] == "ok" and "256.0MiB allocated" in checks["state dir"]["detail"]
    assert checks["last write"]["status"] == "ok" and checks["last write"]["detail"].startswith("last commit ")
    assert report["daemon"]["host"]["locked"] == (checks["memlock"]["status"] == "ok")

    os.chmod(d.socket, 0o666)
    text = cli("doctor", "--socket", d.socket)
    socket_line = next(line for line in text.stdout.splitlines() if line.split()[1] == "socket")
    assert socket_line.startswith("warn") and "mode 0666" in socket_line and "other users can connect" in socket_line
    assert text.stdout.splitlines()[-1].endswith("warnings")


def test_doctor_checks_fail_on_bad_facts(tmp_path, start):
    d = start("d", "--host-capacity", "64MiB", "--disk-capacity", "256MiB")
    facts = cli_json("doctor", "--socket", d.socket)["daemon"]
    disk = facts["disk"]
    stuck = {**facts, "disk": {**disk, "queue_depth": 7, "last_write_time": facts["time"] - 300}}
    status = {c.name: c for c in daemon_checks(stuck)}
    assert status["last write"].status == "fail" and "7 writes queued" in status["last write"].detail
    never = {**facts, "disk": {**disk, "queue_depth": 3, "last_write_time": 0.0}}
    assert {c.name: c.status for c in daemon_checks(never)}["last write"] == "fail"
    corrupt = {**facts, "disk": {**disk, "corrupt_pages": 2, "stale_readers_cleared": 1}}
    status = {c.name: c for c in daemon_checks(corrupt)}
    assert status["lmdb"].status == "warn" and "2 corrupt pages" in status["lmdb"].detail
    assert status["lmdb readers"].status == "warn"
    bloated = {**facts, "state_usage": {**facts["state_usage"], "allocated_bytes": 2 << 30}}
    assert {c.name: c.status for c in daemon_checks(bloated)}["state dir"] == "warn"
    full = {**facts, "state_fs": {"free_bytes": 1 << 20, "total_bytes": 1 << 40}}
    assert {c.name: c.status for c in daemon_checks(full)}["free disk"] == "fail"
    unlocked = {**facts, "host": {**facts["host"], "locked": False, "mlock": True}, "memlock_limit": [8 << 20, 8 << 20]}
    status = {c.name: c for c in daemon_checks(unlocked)}
    assert status["memlock"].status == "warn" and "LimitMEMLOCK=infinity" in status["memlock"].detail
    healthy = {**facts, "disk": {**disk, "queue_depth": 0, "corrupt_pages": 0, "stale_readers_cleared": 0}}
    assert all(c.status != "fail" for c in daemon_checks(healthy))


# -- export / import -----------------------------------------------------------------------

def test_export_then_import_warms_a_fresh_daemon(tmp_path, start, exported):
    a, path, salt = exported
    header, records = split_file(path.read_bytes())
    desc = decode_header(header)
    assert desc.salt.hex() == salt and desc.namespace.model == "test-model" and desc.page_bytes == 768
    assert len(records) == DISK_PAGES + 1  # and the end record

    b = start("b", "--host-capacity", "64MiB", "--disk-capacity", "256MiB",
              env={"HICACHE_LOAD_POLICY": "wait_complete"})
    out = cli_json("import", "--socket", b.socket, "--chunk-bytes", "1500", str(path))
    assert out == {"file": str(path), "namespace": salt, "model": "test-model", "pages": DISK_PAGES,
                   "imported_pages": DISK_PAGES, "skipped_pages": 0}
    assert call(b, "stats")["tiers"]["disk"]["pages"] == DISK_PAGES
    (ns,) = cli_json("ls", "--socket", b.socket)["namespaces"]
    assert ns["namespace"] == salt and ns["pages"] == {"device": 0, "host": 0, "disk": DISK_PAGES}

    # an engine on B loads every conversation A's engines computed, byte for byte, from disk
    loads = run_worker(b.socket, *(f"load:{op}" for op in STORED))
    assert [r["loaded"] for r in loads] == list(STORED.values())
    assert all(r["bad_pages"] == 0 for r in loads)
    assert loads[0]["host_len"] == 10 and loads[0]["device_len"] == 0  # came up from B's disk

    # the imported namespace is remembered: B restarts with the pages
    assert b.stop() == 0
    b.start()
    assert call(b, "stats")["tiers"]["disk"]["pages"] == DISK_PAGES
    (again,) = run_worker(b.socket, "load:5:48:24")
    assert again["loaded"] == 12 and again["bad_pages"] == 0


def as_version_1(data: bytes) -> bytes:
    """An export file as an older hicache wrote it: version 1, crc32 at the end of each record."""
    header, records = split_file(data)
    head = bytearray(header[:-CRC.size])
    FILE_HEAD.pack_into(head, 0, *(FILE_HEAD.unpack_from(head)[:1] + (1,) + FILE_HEAD.unpack_from(head)[2:]))
    parts = [bytes(head) + CRC.pack(zlib.crc32(head))]
    for rec in records:
        body = rec[:-XXH3.size]
        parts.append(body + CRC.pack(zlib.crc32(body)))
    return b"".join(parts)


def test_a_version_1_file_still_imports(tmp_path, start, exported):
    _, path, salt = exported
    old = tmp_path / "old.hicache"
    old.write_bytes(as_version_1(path.read_bytes()))
    n_head = header_length(old.read_bytes()[:FILE_HEAD.size])
    assert decode_header(old.read_bytes()[:n_head]).version == 1
    b = start("b", "--host-capacity", "64MiB", "--disk-capacity", "256MiB")
    out = cli_json("import", "--socket", b.socket, "--chunk-bytes", "1500", str(old))
    assert out["pages"] == DISK_PAGES and out["imported_pages"] == DISK_PAGES and out["namespace"] == salt
    loads = run_worker(b.socket, "load:5:48:24")
    assert loads[0]["loaded"] == 12 and loads[0]["bad_pages"] == 0
    damaged = bytearray(old.read_bytes())
    damaged[n_head + 200] ^= 1  # in the first page: its crc32 still guards it
    old.write_bytes(bytes(damaged))
    c = start("c", "--host-capacity", "64MiB", "--disk-capacity", "256MiB")
    bad = cli("import", "--socket", c.socket, str(old))
    assert bad.returncode == 1 and "record 1: checksum mismatch" in bad.stderr


def test_import_twice_changes_nothing_more(tmp_path, start, exported):
    _, path, _ = exported
    b = start("b", "--host-capacity", "64MiB", "--disk-capacity", "256MiB")
    for _ in range(2):
        cli_json("import", "--socket", b.socket, str(path))
    assert call(b, "stats")["tiers"]["disk"]["pages"] == DISK_PAGES
    assert cli_json("ls", "--socket", b.socket)["namespaces"][0]["pages"]["disk"] == DISK_PAGES


def _damaged(data: bytes) -> dict[str, bytes]:
    header, records = split_file(data)
    flipped = bytearray(data)
    flipped[len(header) + len(records[0]) + 200] ^= 0x01  # inside the second page's bytes
    future = bytearray(header)
    future[8] = 3  # format version 3
    big = ExportHeader.for_namespace(Namespace("huge", KVLayout("mha", num_layers=64, page_size=64, num_kv_heads=8,
                                                                 head_dim=128)))
    return {
        "flipped byte": bytes(flipped),
        "truncated": data[:-100],
        "no end record": data[:-len(records[-1])],
        "wrong magic": b"NOTHICAC" + data[8:],
        "future version": bytes(future) + data[len(header):],
        "foreign file": b"\x7fELF" + bytes(4096),
        "pages bigger than the host slab": big.encode() + encode_end(0, 0),
    }


@pytest.mark.parametrize("damage", [
    "flipped byte", "truncated", "no end record", "wrong magic", "future version", "foreign file",
    "pages bigger than the host slab"])
def test_a_bad_file_is_refused_and_changes_nothing(tmp_path, start, exported, damage):
    _, path, _ = exported
    bad = tmp_path / "bad.hicache"
    bad.write_bytes(_damaged(path.read_bytes())[damage])
    b = start("b", "--host-capacity", "64MiB", "--disk-capacity", "256MiB")
    out = cli("import", "--socket", b.socket, str(bad))
    assert out.returncode == 1 and out.stdout == ""
    message = out.stderr.strip()
    assert len(message.splitlines()) == 1 and message.startswith("hicache: ")
    expected = {"flipped byte": "record 2: checksum mismatch", "truncated": "truncated",
                "no end record": "no end record", "wrong magic": "not a hicache export file",
                "future version": "format version 3", "foreign file": "not a hicache export file",
                "pages bigger than the host slab": "need host slabs of twice that"}[damage]
    assert expected in message
    st = call(b, "stats")
    assert st["namespaces"] == 0 and st["tiers"]["disk"]["pages"] == 0
    assert cli_json("ls", "--socket", b.socket) == {"namespaces": []}


def test_the_daemon_verifies_chunks_itself(tmp_path, start, exported):
    """A client that skips the file check still cannot get a bad page in."""
    _, path, _ = exported
    header, records = split_file(path.read_bytes())
    pages, end = records[:-1], records[-1]
    b = start("b", "--host-capacity", "64MiB", "--disk-capacity", "256MiB")
    conn = RpcConnection.connect(b.socket, timeout_s=30)
    conn.hello()
    imp = conn.call("import_open", {"header": header})["import"]

    desc = decode_header(header)
    flipped = bytearray(pages[1])
    flipped[-10] ^= 0xFF
    # a forged record: other tokens, a valid checksum, but the key of the original
    first_key = pages[0][1:17]
    forged = encode_page(first_key, None, tokens_for(77, 4).tobytes(), bytes(desc.page_bytes))
    # a well-formed page whose parent was never sent
    orphan_tokens = tokens_for(78, 8)
    k0, k1 = page_keys(desc.salt, orphan_tokens, 4)
    orphan = encode_page(k1, k0, orphan_tokens[4:].tobytes(), bytes(desc.page_bytes))
    bad_chunks = {
        "checksum mismatch": pages[0] + bytes(flipped),
        "is not the hash of its parent and tokens": forged,
        "comes before its parent": orphan,
        "the end record counts": pages[0] + end,
        "data after the end record": pages[0] + encode_end(1, desc.page_bytes) + pages[1],
    }
    for expected, chunk in bad_chunks.items():
        with pytest.raises(ClientError, match=expected) as err:
            conn.call("import_pages", {"import": imp, "data": chunk})
        assert err.value.code == "BAD_PARAMS"
        st = call(b, "stats")
        assert st["namespaces"] == 0 and st["tiers"]["disk"]["pages"] == 0, expected
    # the same import goes on with good chunks: nothing of the refused ones stuck
    done = None
    for i in range(0, len(pages), 5):
        done = conn.call("import_pages", {"import": imp, "data": b"".join(pages[i:i + 5])})
    done = conn.call("import_pages", {"import": imp, "data": end})
    conn.close()
    assert done["done"] and done["imported_pages"] == DISK_PAGES
    assert call(b, "stats")["tiers"]["disk"]["pages"] == DISK_PAGES


def test_export_needs_an_unambiguous_namespace_on_disk(tmp_path, start, exported):
    a, _, salt = exported
    out = cli("export", "--socket", a.socket, "--namespace", "test-model", str(tmp_path / "x"))
    assert out.returncode == 1 and "is ambiguous" in out.stderr and salt[:16] in out.stderr
    out = cli("export", "--socket", a.socket, "--namespace", "no-such-model", str(tmp_path / "x"))
    assert out.returncode == 1 and "no namespace matches 'no-such-model'" in out.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.part").exists()
    nodisk = start("nodisk", "--host-capacity", "64MiB", "--no-disk")
    run_worker(nodisk.socket, "store:1:16")
    out = cli("export", "--socket", nodisk.socket, "--namespace", "test-model", str(tmp_path / "x"))
    assert out.returncode == 1 and "without a disk tier" in out.stderr
    out = cli("import", "--socket", nodisk.socket, str(exported[1]))
    assert out.returncode == 1 and "without a disk tier" in out.stderr


def test_settle_waits_for_the_disk_and_refuses_bad_timeouts(exported):
    """`settle` (replays call it between requests) answers settled once the disk writes are
    committed; a bad timeout is refused and changes nothing."""
    a, _, _ = exported
    before = call(a, "stats")["tiers"]["disk"]["pages"]
    assert call(a, "settle", {"timeout_s": 30}) == {"settled": True}
    for bad in (-1, 61, "soon", None):
        with pytest.raises(ClientError) as e:
            call(a, "settle", {"timeout_s": bad})
        assert e.value.code == "BAD_PARAMS"
    assert call(a, "stats")["tiers"]["disk"]["pages"] == before > 0


def test_export_and_import_show_progress_only_on_a_terminal(tmp_path, start, exported):
    a, path, salt = exported
    out = tmp_path / "again.hicache"
    shown = run_on_pty([sys.executable, "-m", "hicache.cli", "export", "--socket", a.socket, "--namespace",
                        salt[:12], "--chunk-bytes", "2KiB", str(out)], stdout_tty=False, stderr_tty=True)
    assert shown.returncode == 0, shown.terminal
    assert f"export {salt[:12]}: 100% {DISK_PAGES}/{DISK_PAGES} pages" in shown.terminal
    assert shown.stdout.startswith(f"exported {DISK_PAGES} pages")  # stdout keeps its one line
    b = start("b", "--host-capacity", "64MiB", "--disk-capacity", "256MiB")
    shown = run_on_pty([sys.executable, "-m", "hicache.cli", "import", "--socket", b.socket, "--chunk-bytes", "1500",
                        str(out)], stdout_tty=False, stderr_tty=True)
    assert shown.returncode == 0, shown.terminal
    assert f"import: checking the file: {DISK_PAGES} pages" in shown.terminal
    assert f"import: sending: 100% {DISK_PAGES}/{DISK_PAGES} pages" in shown.terminal
    # into a pipe (scripts, logs) nothing but the result
    quiet = cli("export", "--socket", a.socket, "--namespace", salt[:12], str(tmp_path / "third.hicache"))
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
