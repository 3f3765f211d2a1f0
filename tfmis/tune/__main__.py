"""`python -m tfmis.tune`: see `tfmis.tune.cli`."""

import sys

from tfmis.tune.cli import main

sys.exit(main())
