import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tests")); import conftest  # noqa
import numpy as np
import pymlxc.core as mx
from pymlxc.backends.metal import cuda_rope_kv
from pymlxc.backends.metal.models.base import RoPE
rope = RoPE(16, base=10000.0); spec = cuda_rope_kv.rope_of(rope, 16)
rng = np.random.default_rng(0)
for layout in ("row", "permuted"):
    k = mx.array(rng.standard_normal((1, 2, 20, 16)).astype(np.float32)); v = mx.array(rng.standard_normal((1, 2, 20, 16)).astype(np.float32))
    idx = mx.array(list(range(20)) + [0] * 6)
    kb, vb = mx.take(k, idx, axis=2), mx.take(v, idx, axis=2)
    if layout == "row":
        kb, vb = mx.contiguous(kb, False), mx.contiguous(vb, False)
    kb, vb = kb * mx.array(1.0), vb * mx.array(1.0)
    wk, wv = mx.contiguous(kb, False) + 0, mx.contiguous(vb, False) + 0
    mx.eval(kb, vb, wk, wv)
    ok = True
    for p in (20, 21, 22):
        qk = mx.array(rng.standard_normal((1, 6, 1, 16)).astype(np.float32)); vv = mx.array(rng.standard_normal((1, 2, 1, 16)).astype(np.float32))
        pos = mx.array(p, dtype=mx.int32)
        q, kb, vb = cuda_rope_kv.rope_write_kv(qk, vv, pos, kb, vb, spec, 4)
        out = mx.fast.scaled_dot_product_attention(q, mx.slice(kb, [0,0,0,0],[1,2,p+1,16],[1,1,1,1]), mx.slice(vb, [0,0,0,0],[1,2,p+1,16],[1,1,1,1]), scale=0.25)
        wq, wk, wv = cuda_rope_kv.reference(qk, vv, pos, wk, wv, rope, 4)
        want = mx.fast.scaled_dot_product_attention(wq, mx.slice(wk, [0,0,0,0],[1,2,p+1,16],[1,1,1,1]), mx.slice(wv, [0,0,0,0],[1,2,p+1,16],[1,1,1,1]), scale=0.25)
        mx.eval(out, want)
        print(layout, p, "q", bool(mx.array_equal(q, wq).item()), "k", bool(mx.array_equal(kb, wk).item()), "v", bool(mx.array_equal(vb, wv).item()), "attn", bool(mx.array_equal(out, want).item()), flush=True)
