"""``python -m lmtrain``: see ``lmtrain.cli``."""

import sys

from lmtrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
