"""The draft sources the decoder runs without training: ar, early exit, layer skip, a separate draft model,
prompt lookup and lookahead (one file each, behind decode/protocol.py)."""
