"""``python -m sdkiln``: the ``sdkiln`` command, as torchrun launches it (``torchrun ... -m sdkiln run``)."""

import sys

from sdkiln.cli import main

sys.exit(main())
