"""Constrained against free decoding on any OpenAI-compatible server (kvgate's engine, llama.cpp's
llama-server), the same way for each: chat completions at concurrency 1 and 32, free
(`ignore_eos`) and with a JSON schema that forces at least MAX_TOKENS tokens, so that both sides
generate the same lengths; runs interleaved free, schema, free, schema. Output tokens/s is the
completion tokens of all requests over the wall time of the run.

usage: python structured_bench.py BASE_URL MODEL LABEL [MAX_TOKENS]   -> one JSON line per batch
"""
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

base, model, label = sys.argv[1], sys.argv[2], sys.argv[3]
max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 64
schema = {
    "type": "array",
    "items": {"type": "string", "pattern": "^[a-z]{6}$"},
    "minItems": 40,
    "maxItems": 40,
}


def one(i, constrained):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"List forty six-letter words, set {i}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "words", "schema": schema}}
    else:
        body["ignore_eos"] = True
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    if constrained:
        text = out["choices"][0]["message"]["content"]
        assert text.startswith("["), text
    return out["usage"]["completion_tokens"]


def run(batch, requests, constrained):
    start = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        tokens = sum(pool.map(lambda i: one(i, constrained), range(requests)))
    return tokens / (time.perf_counter() - start)


run(4, 4, True)  # warm-up (and the schema compiled once)
for batch in (1, 32):
    requests = 4 if batch == 1 else 64
    free, constrained = [], []
    for _ in range(2):
        free.append(run(batch, requests, False))
        constrained.append(run(batch, requests, True))
    f, c = sum(free) / 2, sum(constrained) / 2
    print(json.dumps({"server": label, "batch": batch, "free_tok_s": round(f, 1),
                      "schema_tok_s": round(c, 1), "ratio": round(c / f, 3)}))
