"""``python -m service.cli``: the ``hoist`` command."""

import sys

from service.cli.entry import main

sys.exit(main())
