import sys

from sglang_farskip.boundary.check import main

sys.exit(main())
