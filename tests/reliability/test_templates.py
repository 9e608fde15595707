"""Hostile chat templates: each would hang the process or take gigabytes without the render's bounds,
so each runs in a child process (with its address space capped near what it uses), and must end
with ChatTemplateError naming the bound, quickly. Through `chat()`, the call's timeout and cancel stop
a render that would run for hours, and the model is fine afterwards."""
from __future__ import annotations

import pytest

from .subproc import run_case

# A child's own memory cap: a bound that no longer holds shows as MemoryError, not as a swapping machine.
CAP = """
import resource, time
from pymlxc.backends.metal.chat_template import ChatTemplateError, render_chat
def _vm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0
resource.setrlimit(resource.RLIMIT_AS, (_vm() + (1 << 30), resource.RLIM_INFINITY))
class Tok:
    chat_template = TEMPLATE
    model_type = "llama"
    special_tokens = {"bos_token": "<s>"}
start = time.perf_counter()
try:
    text = render_chat([{"role": "user", "content": "x"}], Tok(), seconds=2.0)
    report({"ok": len(text), "seconds": time.perf_counter() - start})
except ChatTemplateError as exc:
    report({"error": str(exc), "seconds": time.perf_counter() - start})
"""

HOSTILE = {
    "nested ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
                      "longer than 2 s"),
    "nested ranges, no output": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                                 "longer than 2 s"),
    "exponential macro": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                          "longer than 2 s"),
    "string repetition": ("{{ 'a' * 3000000000 }}", "over the limit"),
    "list repetition": ("{{ ([1] * 3000000000)|length }}", "over the limit"),
    "tojson indent": ("{{ messages|tojson(indent=10**9) }}", "indent"),
    "huge power": ("{{ 10 ** (10 ** 10) }}", "bits"),
    "center filter": ("{{ 'a'|center(3000000000) }}", "over the limit"),
    "percent width": ("{{ '%03000000000d' % 1 }}", "over the limit"),
    "format width": ("{{ '{:3000000000}'.format(1) }}", "over the limit"),
    "namespace doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                           "{% endfor %}{{ ns.s }}", "over the limit"),
    "shared nesting printed": ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}"
                               "{% endfor %}{{ ns.l }}", "over the limit"),
    "macro output": ("{% set ns = namespace(s='a' * 16000000) %}{% macro f() %}{% for i in range(4000) %}{{ ns.s }}"
                     "{% endfor %}{% endmacro %}{{ f() }}", "over the limit"),
    "join": ("{% set ns = namespace(s='a' * 1000000) %}{{ ([ns.s] * 10000)|join }}", "over the limit"),
    "replace": ("{{ ('a' * 1000000)|replace('', 'b' * 1000000) }}", "over the limit"),
    "indent filter": ("{{ ('\\n' * 1000000)|indent(1000000) }}", "over the limit"),
    "prompt size": ("{% for i in range(100000) %}{{ 'a' * 1000 }}{% endfor %}", "over the limit"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_ends_with_an_error_naming_its_bound(name: str) -> None:
    template, message = HOSTILE[name]
    result = run_case(f"TEMPLATE = {template!r}\n" + CAP, timeout=60)
    assert "error" in result, result
    assert message in result["error"] and "MemoryError" not in result["error"], result
    assert result["seconds"] < 5.0, result


CHAT = """
import threading, time
import pymlxc
from pymlxc import GenerationCancelled
from pymlxc.backends.metal import chat_template
from pymlxc.backends.metal.chat_template import ChatTemplateError
from pymlxc.testing import write_tiny_model
import tempfile
path = write_tiny_model(tempfile.mkdtemp() + "/m", "llama", seed=0, chat_template=TEMPLATE)
user = [{"role": "user", "content": "hi"}]
out = {}
def timed(**options):
    # A stop (timeout, cancel) ends the stream quietly with the reason in err(), as while decoding;
    # the template's own bound is an error raised at the call.
    start = time.perf_counter()
    try:
        list(model.chat(user, **options))
    except (GenerationCancelled, ChatTemplateError) as exc:
        return ["raised " + type(exc).__name__, time.perf_counter() - start, str(exc)]
    err = model.err()
    if err is None:
        return ["ok", time.perf_counter() - start]
    return [type(err).__name__, time.perf_counter() - start, str(err)]
with pymlxc.load_model(str(path), backend="metal") as model:
    out["timeout"] = timed(timeout=0.5)
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    out["cancel"] = timed(cancel=cancel)
    chat_template.RENDER_SECONDS = 1.0
    out["bound"] = timed()
    out["after"] = len([t.id for t in model.generate("hello", max_tokens=3)])
report(out)
"""


def test_chat_renders_under_the_calls_timeout_and_cancel() -> None:
    template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    out = run_case(f"TEMPLATE = {template!r}\n" + CHAT, timeout=120)
    assert out["timeout"][0] == "GenerationCancelled" and "timed out" in out["timeout"][2], out
    assert out["cancel"][0] == "GenerationCancelled" and "cancelled" in out["cancel"][2], out
    assert out["bound"][0] == "raised ChatTemplateError" and "longer than 1 s" in out["bound"][2], out
    for key in ("timeout", "cancel", "bound"):
        assert 0.4 < out[key][1] < 3.0, out
    assert out["after"] == 3
