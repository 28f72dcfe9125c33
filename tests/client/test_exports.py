"""The names an engine imports from ``hicache.client`` are the client's own classes, and
importing the package's wire modules (as the daemon does) does not load the client."""

import subprocess
import sys

import pytest


def test_package_exports_the_client_and_its_hint():
    import hicache.client as package
    from hicache.client import HiCacheClient, RetainHint
    from hicache.client.client import HiCacheClient as client_class
    from hicache.client.hints import RetainHint as hint_class

    assert HiCacheClient is client_class and RetainHint is hint_class
    assert sorted(package.__all__) == ["HiCacheClient", "RetainHint"]
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        package.NoSuchName


def test_wire_modules_import_without_the_client():
    probe = ("import sys, hicache.client.connection; "
             "print('hicache.client.client' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
