"""``python -m logra_optim.cli``: the same as the ``logra`` command."""

import sys

from . import main

sys.exit(main())
