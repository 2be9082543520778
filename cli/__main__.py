"""`python -m cli ...`: the `ppoflow` command (cli/main.py), for where the console script is not on PATH (torchrun's
`-m cli worker ...`, tests that run the command as a subprocess)."""

import sys

from cli.main import main

sys.exit(main())
