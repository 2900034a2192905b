"""`python -m operators.kubernetes.drill`: see operators/kubernetes/drill/run.py."""

import sys

from operators.kubernetes.drill.run import main

sys.exit(main())
