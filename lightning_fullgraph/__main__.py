"""``python -m lightning_fullgraph``: the ``lightning-fullgraph`` command line."""

import sys

from lightning_fullgraph.cli import main

if __name__ == "__main__":
    sys.exit(main())
