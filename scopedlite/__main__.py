"""``python -m scopedlite``: see :mod:`scopedlite._cli`."""

import sys

from scopedlite._cli import main

if __name__ == "__main__":
    sys.exit(main())
