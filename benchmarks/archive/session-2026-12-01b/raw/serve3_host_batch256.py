import sys, time, cProfile, pstats, os
sys.path.insert(0, os.environ.get("SRC", "src"))
import torch
torch.set_num_threads(1)
from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams
torch.manual_seed(0)
m = TransformerLM(ModelConfig(vocab_size=512, context_length=2048, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2)).eval()
S = 256
eng = Engine(m, block_size=16, max_num_seqs=S, num_blocks=S * 100, max_num_batched_tokens=S * 1100)
fixed = torch.randn(S, 512)
eng._forward = lambda batch: fixed[: batch.last_rows.shape[0]]
for i in range(S):
    eng.add_request([i % 500 + 1 for i in range(int(os.environ.get("P", 128)))], SamplingParams(temperature=0.6, max_tokens=500, ignore_eos=True))
eng.step(); eng.step()
ts = []
for _ in range(30):
    t0 = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t0)
ts.sort(); print("stub step at batch", len(eng.running), f"{ts[len(ts)//2]*1e3:.2f} ms")
if os.environ.get("PROF"):
    pf = cProfile.Profile(); pf.enable()
    for _ in range(20): eng.step()
    pf.disable(); pstats.Stats(pf).sort_stats("tottime").print_stats(14)
