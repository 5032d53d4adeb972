"""``python -m capgate``."""

import sys

from capgate.cli import main

sys.exit(main())
