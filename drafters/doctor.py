"""`python -m drafters.doctor ...`, the documented command: the doctor lives in drafters/serving/doctor.py."""

from __future__ import annotations

import sys

from drafters.serving.doctor import main

if __name__ == "__main__":
    sys.exit(main())
