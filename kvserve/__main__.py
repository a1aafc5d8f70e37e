"""`python -m kvserve ...`: the same commands as the `kvserve` script (kvserve.cli)."""

from __future__ import annotations

import sys

from kvserve.cli import main

sys.exit(main())
