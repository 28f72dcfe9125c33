from pathlib import Path

import pytest

from hicache.config import Config, load_config, parse_size
from hicache.errors import ConfigError


@pytest.mark.parametrize("text,value", [("512MiB", 512 << 20), ("4GiB", 4 << 30), ("1.5G", 1_500_000_000),
                                        ("1048576", 1 << 20), (" 2 kib ", 2048), (7, 7)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "12XB", "-1", "GiB", True, -5])
def test_bad_sizes(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_precedence_defaults_toml_env_flags(tmp_path: Path):
    toml = tmp_path / "h.toml"
    toml.write_text('[hicache]\nhost_capacity = "1GiB"\nwrite_policy = "write_back"\nmax_inflight = 9\n')
    cfg = load_config(toml, environ={"HICACHE_HOST_CAPACITY": "2GiB", "HICACHE_MAX_INFLIGHT": "11",
                                     "HICACHE_STATE_DIR": str(tmp_path)},
                      overrides={"host_capacity": "3GiB", "socket_path": None})
    assert cfg.host_capacity == 3 << 30  # flag wins
    assert cfg.max_inflight == 11  # env beats TOML
    assert cfg.write_policy == "write_back"  # TOML beats the default
    assert cfg.state_dir == tmp_path


def test_embedded_defaults_need_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    cfg = Config()
    assert cfg.socket_path == tmp_path / "run" / "hicache.sock"
    assert cfg.state_dir == tmp_path / "state" / "hicache"
    assert cfg.host_capacity >= 64 << 20 and 64 << 20 <= cfg.disk_capacity <= 4 << 30


@pytest.mark.parametrize("key,value", [("write_policy", "sometimes"), ("load_policy", "eager"),
                                       ("max_inflight", 0), ("metrics_port", 70000), ("durability", "paranoid"),
                                       ("eviction_policy", "mru"), ("index_clock", "sundial")])
def test_bad_values_are_refused(key, value):
    with pytest.raises(ConfigError):
        load_config(environ={}, overrides={key: value})


def test_unknown_toml_key_and_bad_toml(tmp_path):
    (tmp_path / "a.toml").write_text("hostcapacity = 5\n")
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(tmp_path / "a.toml", environ={})
    (tmp_path / "b.toml").write_text("host_capacity = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "b.toml", environ={})


def test_admin_groups_and_limits(tmp_path):
    cfg = load_config(environ={"HICACHE_ADMIN_GIDS": "root, 4242", "HICACHE_MAX_OUTPUT_BYTES": "1MiB",
                               "HICACHE_MAX_TOTAL_BUFFER_BYTES": "1GiB", "HICACHE_MAX_DEVICE_PAGES": "1000",
                               "HICACHE_STATE_DIR": str(tmp_path)})
    assert cfg.admin_gids == (0, 4242)  # a group name or a number, as allowed_gids
    assert cfg.max_output_bytes == 1 << 20 and cfg.max_total_buffer_bytes == 1 << 30
    assert cfg.max_device_pages == 1000 and cfg.max_request_pages == 1 << 20


@pytest.mark.parametrize("key,value", [("max_output_bytes", 0), ("max_event_backlog_bytes", 0),
                                       ("max_request_pages", 0), ("max_device_pages", 1 << 31),
                                       ("max_total_buffer_bytes", "1MiB"), ("admin_gids", "no-such-group")])
def test_bad_limits_are_refused(key, value, tmp_path):
    with pytest.raises(ConfigError):
        load_config(environ={"HICACHE_STATE_DIR": str(tmp_path)}, overrides={key: value})


def test_quotas_from_toml_env_and_flags(tmp_path):
    toml = tmp_path / "q.toml"
    toml.write_text('[hicache]\nhost_capacity = "1GiB"\ndisk_capacity = "4GiB"\n'
                    '[[hicache.quotas]]\nmodel = "llama"\nextra_key = "tenant-a"\ntier = "host"\nmin = "25%"\n'
                    'max = "512MiB"\n'
                    '[[hicache.quotas]]\nnamespace = "' + "ab" * 16 + '"\ntier = "disk"\nmin = "1GiB"\n')
    cfg = load_config(toml, environ={"HICACHE_STATE_DIR": str(tmp_path)})
    host, disk = cfg.quotas
    assert (host.model, host.extra_key, host.tier, str(host.min), str(host.max)) == (
        "llama", "tenant-a", "host", "25%", "512.0MiB")
    assert host.bounds(cfg.host_capacity) == (256 << 20, 512 << 20)
    assert disk.namespace == "ab" * 16 and disk.max is None and disk.bounds(cfg.disk_capacity) == (1 << 30, 4 << 30)
    env = {"HICACHE_STATE_DIR": str(tmp_path), "HICACHE_HOST_CAPACITY": "1GiB",
           "HICACHE_QUOTAS": "model=a,tier=host,min=10%;model=b,tier=host,max=50%"}
    assert [q.model for q in load_config(environ=env).quotas] == ["a", "b"]
    flags = load_config(environ=env, overrides={"quotas": ["model=c,tier=host,min=1GiB"]})
    assert [q.model for q in flags.quotas] == ["c"]  # the flags replace the variable's


@pytest.mark.parametrize("spec, why", [
    ("model=m,tier=device,min=1%", "quota tier must be one of"),
    ("model=m,tier=host,min=60%,max=50%", "more than max"),
    ("model=m,tier=host,min=2GiB", "more than the tier"),
    ("model=m,tier=host,min=120%", "between 0% and 100%"),
    ("tier=host,min=1%", "by model"),
    ("extra_key=x,tier=host", "by model"),
    ("namespace=abc,tier=host", "32 lowercase hex"),
    ("model=m,tier=host,size=1", "unknown keys"),
    ("model=m,min=1%", "no tier"),
    ("model=m,tier", "not key=value"),
    ("model=a,tier=host,min=60%;model=b,tier=host,min=50%", "add up to"),
    ("model=a,tier=host,min=10%;model=a,tier=host,max=50%", "two quotas"),
    ("model=a,tier=disk,min=10%", "no disk tier"),
])
def test_bad_quotas_are_refused_with_the_reason(spec, why, tmp_path):
    with pytest.raises(ConfigError, match=why):
        load_config(environ={"HICACHE_STATE_DIR": str(tmp_path)},
                    overrides={"host_capacity": "1GiB", "disk_enabled": False, "quotas": spec})
