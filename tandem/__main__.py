"""`python -m tandem ...`: the same command line as the `tandem` script."""

import sys

from tandem.cli import main

if __name__ == "__main__":
    sys.exit(main())
