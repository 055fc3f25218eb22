"""`python -m hspec.cli ...`, as the servers that `hspec bench serve` starts run it."""

import sys

from hspec.cli import main

sys.exit(main())
