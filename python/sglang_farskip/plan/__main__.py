"""python -m sglang_farskip.plan: the planner's command line (cli.py)."""

import sys

from sglang_farskip.plan.cli import main

sys.exit(main())
