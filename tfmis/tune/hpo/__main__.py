"""`python -m tfmis.tune.hpo chief|worker DIR ...`: a process of a hyperparameter search (`tfmis.tune.hpo.workers`)."""

import sys

from tfmis.tune.hpo.workers import main

sys.exit(main())
