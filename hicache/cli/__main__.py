"""`python -m hicache.cli`: the `hicache` command (hicache/cli/main.py)."""

import sys

from hicache.cli.main import main

sys.exit(main())
