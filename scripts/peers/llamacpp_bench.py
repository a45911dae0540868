"""llama.cpp (through llama-cpp-python) on the same model and machine as kvgate's model bench:
single-stream greedy decode tok/s and 512-token prefill tok/s, 2 threads, median of 3 runs.

usage: python llamacpp_bench.py MODEL.gguf LABEL
"""
import json
import statistics
import sys
import time

import llama_cpp
from llama_cpp import Llama

path, label = sys.argv[1], sys.argv[2]
llm = Llama(model_path=path, n_ctx=2048, n_batch=512, n_threads=2, n_threads_batch=2, verbose=False)
prompt = llm.tokenize(b"The quick brown fox", add_bos=False)
long_prompt = [(i * 37 + 11) % 30000 + 100 for i in range(512)]


def decode(n=128):
    llm.reset()
    llm.eval(prompt)
    start = time.perf_counter()
    for _ in range(n):
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
        llm.eval([tok])
    return n / (time.perf_counter() - start)


def prefill():
    llm.reset()
    start = time.perf_counter()
    llm.eval(long_prompt)
    return len(long_prompt) / (time.perf_counter() - start)


decode()  # warm-up
result = {
    "engine": "llama.cpp",
    "weights": label,
    "decode_tok_s": statistics.median(decode() for _ in range(3)),
    "prefill_512_tok_s": statistics.median(prefill() for _ in range(3)),
    # The CPU features this build uses (a native build lists AVX512 and the like).
    "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
}
print(json.dumps(result))
