"""`ar`: no drafter — the reference every speculative row is compared against. It lives in the decode core
(decode/ar.py: calibration and the evaluate CLI decode plainly without importing a drafter); the SPEC
registry and existing imports find it here."""

from decode.ar import ARDrafter

__all__ = ["ARDrafter"]
