"""Greedy continuation of token ids with llama.cpp (through llama-cpp-python), for comparing
kvgate's quantized path with llama.cpp's token by token on the same GGUF.

usage: python llamacpp_greedy.py MODEL.gguf N < prompts.jsonl
  each input line: a JSON list of prompt token ids; each output line: the N (or fewer, up to eos)
  greedy token ids as a JSON list.
"""
import json
import sys

from llama_cpp import Llama

path, n = sys.argv[1], int(sys.argv[2])
# logits_all: the scores of the last evaluated token are read back after every eval.
llm = Llama(
    model_path=path,
    n_ctx=2048,
    n_batch=512,
    n_threads=2,
    n_threads_batch=2,
    logits_all=True,
    verbose=False,
)
eos = llm.token_eos()
for line in sys.stdin:
    ids = json.loads(line)
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
        if tok == eos:
            break
        out.append(tok)
        llm.eval([tok])
    print(json.dumps(out), flush=True)
