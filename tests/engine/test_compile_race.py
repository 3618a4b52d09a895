"""Serving beside a background compile (models/decode_graph.py ``trace_fx_once_here``): a
torch.fx trace patches ``nn.Module.__call__`` for the whole process, and the plain ``Tracer``'s
patch raises for a module outside its root, so an eager step that ran during one on another
thread failed (live demos lost requests to it while the first graph compiled). In a fresh
process (Inductor's once-per-process trace has not run yet), every plain-``Tracer`` trace must
happen before the compile thread starts, and eager serving beside the compile loses nothing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, threading, time
from pathlib import Path
import torch
import torch.fx._symbolic_trace as st
from adaflash.config import EngineConfig, SamplingParams
from adaflash.engine.engine import Engine
from adaflash.models.target import load_target
from tests.tiny import build_checkpoint

torch.set_num_threads(1)
traces = []
plain = st.Tracer.trace

def trace(self, root, concrete_args=None):
    traces.append({
        "thread": threading.current_thread().name,
        "plain": type(self).call_module is st.Tracer.call_module,
        "root": getattr(root, "__name__", type(root).__name__),
    })
    return plain(self, root, concrete_args)

st.Tracer.trace = trace
target = load_target(build_checkpoint(Path(sys.argv[1]), "llama", seed=3))
engine = Engine(target, None, EngineConfig(policy="ar", max_running_requests=4))
graph = target.compile_decode((), background=True)
passes, t0 = 0, time.time()
while graph.status() == "compiling" and time.time() - t0 < 600:
    engine.generate([[5, 6, 7, 8]] * 3, SamplingParams(max_new_tokens=4, ignore_eos=True))
    passes += 1
print(json.dumps({"status": graph.status(), "passes": passes, "traces": traces,
                  "errors": engine.stats.request_errors}))
"""


@pytest.mark.slow  # compiles a graph (~0.5–1 min on two cores)
def test_no_plain_fx_trace_runs_on_the_compile_thread_and_serving_beside_it_loses_nothing(
    tmp_path,
):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["status"] == "ready"
    assert seen["passes"] > 0  # eager steps did run while it compiled
    assert any(t["thread"] == "decode-graph" for t in seen["traces"])  # the compiler did trace
    on_thread = [t for t in seen["traces"] if t["plain"] and t["thread"] == "decode-graph"]
    assert on_thread == []
    assert seen["errors"] == 0
