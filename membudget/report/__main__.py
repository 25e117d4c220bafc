import sys

from membudget.report.cli import main

sys.exit(main())
