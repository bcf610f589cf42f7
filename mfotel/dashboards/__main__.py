"""`python -m mfotel.dashboards --out DIR [--check]`: render the dashboards (needs the SDK)."""
import sys

from .build import main

sys.exit(main())
