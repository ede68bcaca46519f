"""``python -m recurformer ...``: the same command line as the ``recurformer`` script."""

import sys

from .cli import main

sys.exit(main())
