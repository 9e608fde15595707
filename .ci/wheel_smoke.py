"""Smoke test of an installed pymlxc wheel (run by .ci/check_wheel in a fresh venv without a compiler).

It must import the wheel's copy, not a checkout: run it from outside the source tree.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pymlxc
import pymlxc.core as mx
from pymlxc.core import _loader

site = Path(pymlxc.__file__).resolve().parent
checkout = Path(__file__).resolve().parents[1]
assert not site.is_relative_to(checkout), f"pymlxc imported from the checkout ({site}), not from the installed wheel"
assert Path(_loader._LIB_PATH).is_relative_to(site), f"libmlxc loaded from {_loader._LIB_PATH}, not the wheel"

a = mx.array([[1.0, 2.0], [3.0, 4.0]])
assert (a @ a).tolist() == [[7.0, 10.0], [15.0, 22.0]], (a @ a).tolist()

with tempfile.TemporaryDirectory() as tmp:
    model_dir = Path(tmp) / "tiny-llama"
    subprocess.run([sys.executable, "-m", "pymlxc.testing", "llama", str(model_dir)], check=True)
    with pymlxc.load_model(str(model_dir)) as model:
        tokens = list(model.generate("The capital of France is", max_tokens=3))
    # A random model may emit its end-of-sequence token early; it must still produce the first one.
    assert 1 <= len(tokens) <= 3, tokens
    print(f"wheel smoke test passed: {site}, libmlxc {_loader._LIB_PATH}, tokens {[t.id for t in tokens]}")
