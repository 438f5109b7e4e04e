"""`python -m loadtests ...`: see loadtests/cli.py."""

import sys

from loadtests.cli import main

sys.exit(main())
