"""``python -m cp_passes``: see :mod:`cp_passes.tools.cli`."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
