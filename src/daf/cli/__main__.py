"""``python -m daf.cli`` is the ``daf`` command."""

import sys

from daf.cli import main

if __name__ == "__main__":
    sys.exit(main())
