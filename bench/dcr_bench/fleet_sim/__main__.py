"""``python -m dcr_bench.fleet_sim``: see ``dcr_bench.fleet_sim.run``."""

import sys

from dcr_bench.fleet_sim.run import main

sys.exit(main())
