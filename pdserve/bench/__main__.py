"""`python -m pdserve.bench ...`: the bench CLI without the top-level `pdserve` command."""

import sys

from pdserve.bench.cli import main

sys.exit(main())
