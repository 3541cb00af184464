"""``python -m daf.cli`` is the ``daf`` command."""

import sys

from daf.cli import entry

if __name__ == "__main__":
    sys.exit(entry())
