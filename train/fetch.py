"""`python -m train.fetch NAME ...`, the documented command (= `draftsmith fetch`): the code lives in train/data/fetch.py."""

from __future__ import annotations

import sys

from train.data.fetch import main

if __name__ == "__main__":
    sys.exit(main())
