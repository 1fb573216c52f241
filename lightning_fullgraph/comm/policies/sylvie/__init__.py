"""Sylvie (arXiv 2303.01277): its policy, bounded-staleness pipeline and loss controllers.

``policy`` (its schedule), ``pipeline`` (the buffers and the stale halo path), ``rules`` (the
controllers on the global loss).
"""
