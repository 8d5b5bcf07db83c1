"""``python -m sim [scenario]``: the trace-driven capture demo."""

import sys

from sim.demo import main

sys.exit(main())
