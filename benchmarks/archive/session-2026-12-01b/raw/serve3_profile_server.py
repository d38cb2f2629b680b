"""Ad-hoc: per output token CPU time of the engine thread vs the event-loop thread (server in
this process, clients in a child process), plus where the event loop's busy samples go."""
import sys, threading, time, collections, traceback, subprocess, os
SRC = os.environ.get("SRC", "src")
sys.path.insert(0, SRC)
import importlib.util; sys.argv = ["x", "--_src", SRC]
spec = importlib.util.spec_from_file_location("bs", "benchmarks/serve.py"); bs = importlib.util.module_from_spec(spec); spec.loader.exec_module(bs)
import torch
torch.set_num_threads(1)
bs.DEVICE, bs.GRAPHS = "cpu", False
import uvicorn, socket
from lmforge.serve.server import EngineLoop, ServerState, build_app
from lmforge.serve import Engine
print("lmforge from", sys.modules["lmforge"].__file__)
model, kw, prompts = bs._server_setup(bs.CPU_SERVER_SHAPE, 64, 64)
eng = Engine(model, **kw)
state = ServerState(EngineLoop(eng), bs._IdTokenizer(), "bench-random")
with socket.socket() as sk:
    sk.bind(("127.0.0.1", 0)); port = sk.getsockname()[1]
server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="error"))
th = threading.Thread(target=server.run, daemon=True, name="uvicorn"); th.start()
while not server.started: time.sleep(0.05)
def cpu(t): return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
eth = next(t for t in threading.enumerate() if t.name == "lmforge-engine")
samples = collections.Counter(); stop = False
def sampler():
    while not stop:
        fr = sys._current_frames().get(th.ident)
        if fr is not None and eng.has_unfinished():
            st = traceback.extract_stack(fr)
            if st[-1].name != "select":
                key = " < ".join(f"{f.filename.split('site-packages/')[-1].split('/src/')[-1].split('python3.11/')[-1]}:{f.name}" for f in reversed(st[-4:]))
                samples[key] += 1
        time.sleep(0.0005)
code = f"""
import sys; sys.path.insert(0, 'src')
import importlib.util
spec = importlib.util.spec_from_file_location('bs', 'benchmarks/serve.py'); bs = importlib.util.module_from_spec(spec); spec.loader.exec_module(bs)
bs.DEVICE='cpu'
_, _, prompts = bs._server_setup(bs.CPU_SERVER_SHAPE, 64, 64)
print(bs._load({port}, prompts, 64))
"""
threading.Thread(target=sampler, daemon=True).start()
p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
print('child started', flush=True)
# wait until the load starts (engine busy), then measure until the child ends
while not eng.has_unfinished() and p.poll() is None: time.sleep(0.001)
g0 = eng.stats["generated_tokens"]; e0, u0, w0 = cpu(eth), cpu(th), time.perf_counter()
out = p.communicate()[0]
g1 = eng.stats["generated_tokens"]; e1, u1, w1 = cpu(eth), cpu(th), time.perf_counter()
stop = True
n = g1 - g0
print(out.strip())
print(f"tokens {n}; wall {w1-w0:.2f}s; per output token: engine thread CPU {1e6*(e1-e0)/n:.0f} us, event-loop thread CPU {1e6*(u1-u0)/n:.0f} us, wall {1e6*(w1-w0)/n:.0f} us; load {open('/proc/loadavg').read().split()[0]}")
tot = sum(samples.values())
print(f"event loop busy samples {tot}:")
for k, v in samples.most_common(int(os.environ.get("TOP", 15))): print(f"{v/tot*100:5.1f}%  {k}")
server.should_exit = True
