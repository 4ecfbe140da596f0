"""``python -m kvtierd``: the daemon."""

import sys

from kvtierd.cli.daemon import main

sys.exit(main())
