"""`python -m treeattn` is the `treeattn` command."""

import sys

from ._cli import main


sys.exit(main())
