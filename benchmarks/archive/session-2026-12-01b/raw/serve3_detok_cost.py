import sys, time
sys.path.insert(0, "src")
import importlib.util
spec = importlib.util.spec_from_file_location("bs", "benchmarks/serve.py"); bs = importlib.util.module_from_spec(spec); spec.loader.exec_module(bs)
import torch
torch.set_num_threads(1)
bs.DEVICE = "cpu"
from lmforge.serve import Engine, SamplingParams
model, kw, prompts = bs._server_setup(bs.CPU_SERVER_SHAPE, 64, 64)
for rep in range(2):
    for tok in (None, bs._IdTokenizer()):
        eng = Engine(model, **kw, tokenizer=tok)
        p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        for pr in prompts: eng.add_request(pr, p)
        t0 = time.process_time(); w0 = time.perf_counter(); n = 0
        while eng.has_unfinished(): eng.step(); n += 1
        print("tokenizer" if tok else "ids only", f"steps {n} cpu {time.process_time()-t0:.3f}s wall {time.perf_counter()-w0:.3f}s per token cpu {1e6*(time.process_time()-t0)/4096:.0f} us")
