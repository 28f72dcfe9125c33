"""systemd integration: readiness and watchdog notifications, socket activation.

Both protocols are implemented directly (a datagram and a few environment
variables); nothing here needs libsystemd or python-systemd, and everything is
a no-op outside systemd.

Modules:
  activation.py  Socket activation (sd_listen_fds(3)), without libsystemd.
  sdnotify.py    The systemd notification protocol (sd_notify(3)), without libsystemd.
"""

from hicache.systemd.activation import SD_LISTEN_FDS_START, listen_fds, listen_fds_with_names
from hicache.systemd.sdnotify import Notifier, watchdog_interval_s, watchdog_loop

__all__ = [
    "SD_LISTEN_FDS_START",
    "Notifier",
    "listen_fds",
    "listen_fds_with_names",
    "watchdog_interval_s",
    "watchdog_loop",
]
