"""``python -m drama3_patches.tools``: the ``drama3-patches`` command."""

import sys

from drama3_patches.tools import main

sys.exit(main())
