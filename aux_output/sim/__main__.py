"""``python -m r3capture.aux_output.sim [scenario]``: the trace-driven capture demo."""

import sys

from r3capture.aux_output.sim.demo import main

sys.exit(main())
