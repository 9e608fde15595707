"""`python -m pymlxc.testing ARCH PATH`: write a tiny random model."""
from .tiny import main

raise SystemExit(main())
