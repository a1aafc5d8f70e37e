"""`python -m kvserve ...`: the same commands as the `kvserve` script (kvserve.entrypoints.cli)."""

from __future__ import annotations

import sys

from kvserve.entrypoints.cli import main

sys.exit(main())
