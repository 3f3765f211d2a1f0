"""`python -m tfmis.tuning.hpo chief|worker DIR ...`: a process of a hyperparameter search
(`tfmis.tuning.hpo.workers`)."""

import sys

from tfmis.tuning.hpo.workers import main

sys.exit(main())
