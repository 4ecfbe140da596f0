"""``python -m tools.ttft``: see :mod:`tools.ttft` and :mod:`tools.ttft.cli`."""

import sys

from tools.ttft.cli import main

sys.exit(main())
