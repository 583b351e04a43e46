"""``python -m kcompact ...``: the same as the ``kcompact`` script."""

import sys

from kcompact.connectors.cli import main

sys.exit(main())
