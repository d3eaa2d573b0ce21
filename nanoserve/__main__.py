"""`python -m nanoserve ...`: the same command line as the `nanoserve` script."""

import sys

from nanoserve.cli import main

sys.exit(main())
