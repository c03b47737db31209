"""``python -m fxsched.runtime.cli``: the ``fxsched`` command."""

import sys

from fxsched.runtime.cli.app import main

sys.exit(main())
