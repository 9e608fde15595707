"""The wrappers that `_gen` generates at import, as a module under their `_gen.RAW` names, so that
type checkers see them: their types are declared in `_generated.pyi`, which `_stubgen` writes from
the same signatures (a test holds the committed stub equal to what it writes now)."""
from __future__ import annotations

from ._gen import RAW

globals().update(RAW)
