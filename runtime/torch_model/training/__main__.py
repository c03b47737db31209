"""`python -m fxsched.runtime.torch_model.training train OUT_DIR | evaluate DIR` (cli.py)."""

import sys

from fxsched.runtime.torch_model.training.cli import main

sys.exit(main())
