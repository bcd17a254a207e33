"""The evaluation harness: several drafters on one prompt set against AR, and the report it writes.

evaluate (the `python -m decode.evaluate` body) with runs (the rows it times), prompts (prompt files, chat turns), workers (interleaved
processes), hf_peers (HF generate rows), report + plots + labels + divergence (report.json/.md, PNG plots, row labels, where a row left AR), calibration + autoshape
(`--tree auto`). The runtime it drives (target, trees, verification, the generate loop) is decode/ itself.
"""
