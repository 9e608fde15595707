"""`python -m pymlxc ...`: the `pymlxc` command line (`pymlxc.cli`)."""
from __future__ import annotations

import sys

from pymlxc.cli import main

if __name__ == "__main__":
    sys.exit(main())
