"""``python -m daf.cli`` is the ``daf`` command."""

import sys

from daf.cli import main

sys.exit(main())
