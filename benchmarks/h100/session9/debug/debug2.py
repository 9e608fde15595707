import os, sys, tempfile
from pathlib import Path
os.environ["PYMLXC_DECODE"] = "segmented"
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tests")); import conftest  # noqa
import pymlxc
from pymlxc.testing import write_tiny_model
tmp = Path(tempfile.mkdtemp())
path = write_tiny_model(tmp / "m", "llama", num_layers=2)
def gen(rope, compile_="1", entries=None):
    os.environ["PYMLXC_CUDA_ROPE_KV"] = rope; os.environ["PYMLXC_COMPILE"] = compile_
    kw = {} if entries is None else {"prompt_cache_entries": entries}
    with pymlxc.load_model(str(path), backend="metal", **kw) as m:
        return [[t.id for t in m.generate(text, max_tokens=10)] for text in ("The baker walked", "The baker walked to the river")]
for label, args in [("m rope", ("1",)), ("plain rope", ("1", "1", 0)), ("m norope", ("0",)), ("uncompiled", ("0", "0", 0))]:
    print(label, gen(*args), flush=True)
