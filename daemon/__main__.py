"""``python -m prefixd.daemon``: the same as ``prefixd serve``."""

import sys

from .service.main import main

sys.exit(main())
