"""`python -m mfotel.dashboards [--out DIR] [--check]`."""
import sys

from .build import main

sys.exit(main())
