"""The shipped systemd units: required directives, and systemd's own verifier.

`systemd-analyze verify` on the bare files can only complain that
/usr/local/bin/hicache is missing on this machine (the one allowed message).
Verified under --root= with a stub executable and a copy of the system's
unit directory (for sysinit.target and friends), it must say nothing at all.
Note that verify exits 0 on unknown keys and unparsable values, so the
checks below read its messages, not its exit status.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import hicache.data

UNITS = Path(hicache.data.__file__).resolve().parent / "systemd"  # shipped in the package
SERVICE = UNITS / "hicache.service"
SOCKET = UNITS / "hicache.socket"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")

ALLOWED_BARE = [re.compile(r"^hicache\.service: Command /usr/local/bin/hicache is not executable")]


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections of a unit file as ordered (key, value) lists; keys may repeat."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = (pending + raw.strip()) if pending else raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            assert line.endswith("]"), f"{path.name}: bad section header {line!r}"
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r} is not key=value"
        current.append((key.strip(), value.strip()))
    return sections


def last(section: list[tuple[str, str]], key: str) -> str | None:
    values = [v for k, v in section if k == key]
    return values[-1] if values else None


def test_service_has_the_required_directives():
    svc = parse_unit(SERVICE)["Service"]
    required = {
        "Type": "notify",
        "NotifyAccess": "main",
        "ExecStart": "/usr/local/bin/hicache serve",
        "User": "hicache",
        "Group": "hicache",
        "StateDirectory": "hicache",
        "RuntimeDirectory": "hicache",
        "RuntimeDirectoryPreserve": "yes",
        "LimitMEMLOCK": "infinity",
        "Restart": "on-failure",
        "WatchdogSec": "30",
        "KillSignal": "SIGTERM",
        "UMask": "0007",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateDevices": "yes",
        "DevicePolicy": "closed",
        "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectKernelLogs": "yes",
        "ProtectControlGroups": "yes",
        "ProtectClock": "yes",
        "ProtectHostname": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "RestrictNamespaces": "yes",
        "RestrictRealtime": "yes",
        "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes",
        "MemoryDenyWriteExecute": "yes",
        "SystemCallArchitectures": "native",
        "CapabilityBoundingSet": "",
    }
    wrong = {k: (last(svc, k), v) for k, v in required.items() if last(svc, k) != v}
    assert wrong == {}, "directive: (found, expected)"
    assert "@system-service" in [v for k, v in svc if k == "SystemCallFilter"]
    assert last(svc, "TimeoutStopSec") is not None
    # Must not be set: they break SO_PEERCRED checks / hide /proc/meminfo / drop mlock.
    for forbidden in ("PrivateUsers", "ProcSubset", "DynamicUser", "PrivateNetwork"):
        assert last(svc, forbidden) in (None, "no"), forbidden


def test_socket_matches_the_service():
    unit = parse_unit(SOCKET)
    sock = unit["Socket"]
    assert last(sock, "ListenStream") == "/run/hicache/hicache.sock"
    assert last(sock, "SocketMode") == "0660"
    assert last(sock, "SocketUser") == "hicache"
    assert last(sock, "SocketGroup") == "hicache"
    assert last(sock, "Accept") == "no"
    assert last(unit["Install"], "WantedBy") == "sockets.target"
    # The socket lives in the service's RuntimeDirectory, which must survive restarts.
    svc = parse_unit(SERVICE)["Service"]
    runtime_dir = "/run/" + last(svc, "RuntimeDirectory")
    assert str(Path(last(sock, "ListenStream")).parent) == runtime_dir
    assert last(svc, "RuntimeDirectoryPreserve") == "yes"


def _verify(*args: str) -> list[str]:
    out = subprocess.run(
        [ANALYZE, "verify", "--man=no", *args], capture_output=True, text=True, timeout=120
    )
    lines = (out.stdout + out.stderr).splitlines()
    # Only judge messages about our units; a distro's own units may carry warnings.
    return [line for line in lines if "hicache" in line]


def _system_unit_dir() -> Path | None:
    for candidate in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")):
        if (candidate / "sysinit.target").exists():
            return candidate
    return None


def _root(tmp_path: Path, service_text: str | None = None) -> Path:
    root = tmp_path / "root"
    system_dir = _system_unit_dir()
    if system_dir is None:
        pytest.skip("no system unit directory with sysinit.target")
    shutil.copytree(system_dir, root / "usr/lib/systemd/system", symlinks=True)
    exe = root / "usr/local/bin/hicache"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    etc = root / "etc/systemd/system"
    etc.mkdir(parents=True)
    (etc / "hicache.service").write_text(service_text if service_text is not None else SERVICE.read_text())
    shutil.copy(SOCKET, etc / "hicache.socket")
    return root


@needs_analyze
def test_bare_verify_only_misses_the_executable():
    messages = _verify(str(SERVICE), str(SOCKET))
    unexpected = [m for m in messages if not any(p.search(m) for p in ALLOWED_BARE)]
    assert unexpected == []


@needs_analyze
def test_rooted_verify_is_silent(tmp_path):
    root = _root(tmp_path)
    assert _verify(f"--root={root}", "hicache.service", "hicache.socket") == []


@needs_analyze
def test_rooted_verify_catches_a_broken_unit(tmp_path):
    broken = SERVICE.read_text().replace("ProtectClock=yes", "ProtectClok=yes").replace(
        "LimitMEMLOCK=infinity", "LimitMEMLOCK=lots"
    )
    root = _root(tmp_path, broken)
    messages = _verify(f"--root={root}", "hicache.service", "hicache.socket")
    assert any("Unknown key 'ProtectClok'" in m for m in messages)
    assert any("lots" in m for m in messages)


@needs_analyze
def test_security_exposure_stays_low():
    out = subprocess.run(
        [ANALYZE, "security", "--offline=true", str(SERVICE)], capture_output=True, text=True, timeout=120
    )
    found = re.search(r"Overall exposure level for hicache\.service: (\d+\.\d+)", out.stdout + out.stderr)
    if found is None:
        pytest.skip(f"this systemd-analyze cannot assess offline: {out.stderr.strip()[:200]}")
    # systemd rates <= 2.0 as well hardened ("OK"); ours was 1.4 when written.
    assert float(found.group(1)) <= 2.0
