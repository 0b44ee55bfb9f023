"""`python -m fxmem`: the `fxmem` command."""

import sys

from fxmem.cli import main

sys.exit(main())
