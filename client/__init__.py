"""Client library for the attention encoder service (numpy in, numpy out; no torch needed)."""
