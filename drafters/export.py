"""`python -m drafters.export ...`, the documented command: the exporter lives in drafters/serving/export.py."""

from __future__ import annotations

import sys

from drafters.serving.export import main

if __name__ == "__main__":
    sys.exit(main())
