"""Sylvie (arXiv 2303.01277): ``policy`` (its schedule), ``pipeline`` (the bounded-staleness
buffers and the stale path), ``rules`` (the controllers on the global loss)."""
