"""`python -m decode.evaluate ...`, the documented command: the harness lives in decode/harness/evaluate.py."""

from __future__ import annotations

import sys

from decode.harness.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
