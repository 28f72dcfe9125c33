"""The daemon's lifecycle and its RPC face.

app.py (startup -> serve -> shutdown: the tiers, the movers, signals, systemd),
launcher.py (start a daemon process and wait for its socket), gc_steward.py (the
collector run on the daemon's terms), context.py (what handlers see of the daemon),
handlers.py (decode, call, encode: every wire method), keyed_rpc.py (SGLang's keyed
pages' methods), pin_rpc.py (pin / unpin / prioritize: pinned and prioritized
prefixes), portable.py (export / import sessions), quota_rpc.py (the tenant
quotas' admin methods), tree_view.py (the `tree` view of a namespace's index),
native_paths.py (which hot paths run in C, for stats and the doctor), placement.py
(`--cpus`: the CPUs the daemon and its threads run on).

metrics.py (Prometheus metrics of the daemon, and a loopback-only /metrics endpoint).
"""
