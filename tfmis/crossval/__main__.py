import sys

from tfmis.crossval.cli import main

sys.exit(main())
