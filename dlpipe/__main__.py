"""``python -m dlpipe`` runs the ``dlpipe`` command."""

import sys

from dlpipe.cli import main

sys.exit(main())
