"""`python -m operators.cli.drill`: see operators/cli/drill/run.py."""

import sys

from operators.cli.drill.run import main

sys.exit(main())
