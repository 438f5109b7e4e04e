"""`python -m server.cli`: the `specserve` command from a checkout (tensor-parallel ranks start so)."""

import sys

from server.cli import main

sys.exit(main())
