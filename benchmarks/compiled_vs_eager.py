"""The torch runner compiled against eager, end to end, in one process: plain and draft_model k=4 on the
shipped pair (or another target with the shipped draft: third argument, e.g. the 1B stand-in), greedy,
96 tokens, 3 code prompts, the four LLMs alternating; checks greedy outputs and, where compiled and
eager part, the eager target's top-2 logit gap there. On CUDA (second argument) the step is compiled
with mode="reduce-overhead" and replayed as CUDA graphs; the script prints how many graphs inductor
skipped (0 expected).

    python benchmarks/compiled_vs_eager.py [threads] [cpu|cuda] [target]
"""
import statistics, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
DEVICE = sys.argv[2] if len(sys.argv) > 2 else "cpu"
from specdec import LLM, SamplingParams
T = sys.argv[3] if len(sys.argv) > 3 else "specdec/assets/demo-target"
D = "specdec/assets/demo-draft"
PROMPTS = ["def fibonacci(n):", "import json\n\ndef load_config(path):", "class Stack:\n    def __init__(self):"]
spec = {"method": "draft_model", "model": D, "num_speculative_tokens": 4, "adaptive": False}
llms = {}
for eager in (True, False):
    t = time.time()
    llms[("plain", eager)] = LLM(T, backend="torch", device=DEVICE, enforce_eager=eager)
    llms[("draft k=4", eager)] = LLM(T, backend="torch", device=DEVICE, enforce_eager=eager, speculative_config=spec)
    print(f"load eager={eager}: {time.time() - t:.1f} s", flush=True)
params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
for l in llms.values():
    l.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8))  # warm
rates = {k: [] for k in llms}
outs = {k: [] for k in llms}
for rep in range(2):
    for p in PROMPTS:
        for k, l in llms.items():
            t = time.perf_counter()
            o = l.generate([p], params)[0].outputs[0]
            rates[k].append(len(o.token_ids) / (time.perf_counter() - t))
            if rep == 0:
                outs[k].append(o.token_ids)
from torch._dynamo.utils import counters
print(f"target {T} on {DEVICE}; CUDA graphs skipped by inductor: {counters['inductor']['cudagraph_skips']}")
print("| method | eager tok/s | compiled tok/s | compiled / eager |")
for m in ("plain", "draft k=4"):
    e, c = statistics.median(rates[(m, True)]), statistics.median(rates[(m, False)])
    print(f"| {m} | {e:.1f} | {c:.1f} | {c / e:.2f} |")
for eager in (True, False):
    p, d = statistics.median(rates[("plain", eager)]), statistics.median(rates[("draft k=4", eager)])
    print(f"draft k=4 / plain, {'eager' if eager else 'compiled'}: {d / p:.2f}x")
ref = outs[("plain", True)]
print("outputs equal plain eager:", {f"{m} eager={e}": outs[(m, e)] == ref for (m, e) in outs})
print("path:", llms[("plain", False)].target.describe(), llms[("plain", False)].target.last_path)
for i, p in enumerate(PROMPTS):
    a, b, c = outs[("plain", True)][i], outs[("draft k=4", True)][i], outs[("draft k=4", False)][i]
    first = lambda x, y: next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None)
    print(f"prompt {i}: draft eager vs plain first diff at {first(a, b)}, draft compiled vs plain {first(a, c)}, "
          f"draft compiled vs draft eager {first(b, c)}")
    d = outs[("plain", False)][i]
    print(f"  plain compiled vs plain eager {first(a, d)}, draft compiled vs plain compiled {first(d, c)}")
    j = first(a, d)
    if j is not None:  # the eager target's top-2 gap where compiled and eager part
        from specdec.models.base import ForwardBatch
        tgt = llms[("plain", True)].target
        ids = llms[("plain", True)].tokenizer.encode(p) + a[:j]
        tgt.sync_rows(["gap"])
        lg = tgt.forward(ForwardBatch.from_rows([ids], [0]))[0]
        top = lg.topk(2)
        print(f"  eager top-2 at {j}: {top.indices.tolist()} gap {float(top.values[0] - top.values[1]):.4f}")
