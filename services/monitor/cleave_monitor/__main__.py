"""`python -m cleave_monitor`: the monitor with its settings from CLEAVE_MONITOR_* variables."""

import sys

from cleave_monitor.main import main

sys.exit(main())
