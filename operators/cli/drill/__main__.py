"""`python -m operators.cli.drill`: see operators/cli/drill/run.py."""

from operators.cli.drill.run import main
from operators.utils.processes import exit_without_teardown

exit_without_teardown(main())
