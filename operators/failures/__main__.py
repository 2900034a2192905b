import sys

from operators.failures.cli import main

sys.exit(main())
