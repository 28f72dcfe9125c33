"""Package data: the systemd units, the benches' default trace and its licence, the Grafana dashboard, the
native paths' measured costs.
"""
