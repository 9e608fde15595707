"""Start the worker: `python -m pymlxc.bridge`, or `python path/to/bridge` in a Python without pymlxc."""
import os
import sys

if __package__:
    from .worker import main
else:
    # Run as a folder: load it as a package under a private name, so the worker needs only the
    # standard library and mlx-lm, and its module names cannot shadow anyone else's.
    import importlib.util
    from pathlib import Path

    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    spec = importlib.util.spec_from_file_location(
        "_pymlxc_bridge", here / "__init__.py", submodule_search_locations=[str(here)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["_pymlxc_bridge"] = package
    spec.loader.exec_module(package)
    from _pymlxc_bridge.worker import main  # type: ignore[import-not-found,no-redef]

code = main()
sys.stderr.flush()
# Leave without interpreter shutdown: the stdin reader thread may sit in a blocking read, and
# finalizing a buffered stdin that a thread holds aborts the process instead of exiting cleanly.
os._exit(code)
