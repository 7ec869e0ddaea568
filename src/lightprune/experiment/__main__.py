"""``python -m lightprune.experiment``: the same as the ``lightprune-experiment`` console script."""

import sys

from lightprune.experiment.app import main

if __name__ == "__main__":
    sys.exit(main())
