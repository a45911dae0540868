"""Structured outputs and tools through the official `openai` client, checked with an independent
JSON Schema validator (`jsonschema`).

Usage: structured_outputs.py BASE_URL MODEL API_KEY [SCHEMAS] [REQUIRED]

1. `chat.completions.parse` with a pydantic model, not streamed and streamed: a parsed object.
2. A tool-call round trip: a required call, its result sent back, the final answer.
3. `tool_choice="required"` at temperature 1, REQUIRED times (default 100): every call valid.
4. SCHEMAS random schemas (default 200), seeded: every sample that finishes parses and validates.

Prints one `OK <name> ...` line per part; any failure raises.
"""

import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
from openai import OpenAI
from pydantic import BaseModel, Field

base_url, model, key = sys.argv[1:4]
n_schemas = int(sys.argv[4]) if len(sys.argv) > 4 else 200
n_required = int(sys.argv[5]) if len(sys.argv) > 5 else 100
client = OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
pool = ThreadPoolExecutor(16)


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    pet: Literal["cat", "dog", "none"]


def beta():
    # openai 1.x has the parse helpers under `beta`; 2.x has them on `chat.completions` too.
    return getattr(client.beta, "chat", client).completions


# 1. pydantic parse, full and streamed.
ask = [{"role": "user", "content": "Describe a person as JSON."}]
r = beta().parse(model=model, messages=ask, response_format=Person, temperature=1, seed=3)
assert isinstance(r.choices[0].message.parsed, Person), r
with beta().stream(model=model, messages=ask, response_format=Person, temperature=1, seed=4) as s:
    deltas = sum(1 for e in s if e.type == "content.delta")
    final = s.get_final_completion()
assert isinstance(final.choices[0].message.parsed, Person), final
assert deltas > 1, deltas
print("OK parse", r.choices[0].message.parsed.model_dump_json(), "streamed in", deltas)

# 2. A tool round trip.
weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
r = client.chat.completions.create(
    model=model, messages=messages, tools=[weather], tool_choice="required", temperature=1, seed=5
)
choice = r.choices[0]
assert choice.finish_reason == "tool_calls", choice
call = choice.message.tool_calls[0]
args = json.loads(call.function.arguments)
jsonschema.validate(args, weather["function"]["parameters"])
messages.append(choice.message.model_dump(exclude_none=True))
messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'})
r = client.chat.completions.create(
    model=model, messages=messages, tools=[weather], temperature=0, max_tokens=30
)
answer = r.choices[0].message.content
assert answer, r
print("OK round-trip", call.function.name, call.function.arguments, "->", json.dumps(answer))


# 3. Required calls at temperature 1.
def required(seed):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Weather in city number {seed}?"}],
        tools=[weather],
        tool_choice="required",
        temperature=1,
        seed=seed,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    for call in c.message.tool_calls:
        assert call.function.name == "get_weather", call
        jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])
    return len(c.message.tool_calls)


calls = list(pool.map(required, range(n_required)))
print("OK required", len(calls), "of", n_required, "valid;", sum(calls), "calls")


# 4. Random schemas.
def leaf(rng):
    kind = rng.choice(["integer", "number", "boolean", "enum", "string", "null"])
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 1000}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", 1, 2, True, None], rng.randint(1, 4))}
    if kind == "string":
        s = {"type": "string", "maxLength": rng.randint(1, 12)}
        if rng.random() < 0.3:
            s["pattern"] = rng.choice(["^[a-z]+$", "^[A-Z][a-z]*$", "^[0-9]{2,4}$"])
            s["maxLength"] = rng.randint(4, 12)
        return s
    return {"type": kind}


def schema(rng, depth=0):
    r = rng.random()
    if depth < 2 and r < 0.35:
        props = {f"k{i}": schema(rng, depth + 1) for i in range(rng.randint(1, 3))}
        return {
            "type": "object",
            "properties": props,
            "required": rng.sample(sorted(props), rng.randint(0, len(props))),
            "additionalProperties": False,
        }
    if depth < 2 and r < 0.5:
        return {"type": "array", "items": schema(rng, depth + 1), "minItems": 0, "maxItems": rng.randint(1, 3)}
    if depth < 2 and r < 0.6:
        return {"anyOf": [leaf(rng), leaf(rng)]}
    return leaf(rng)


def constrained(i):
    rng = random.Random(i)
    s = {"type": "object", "properties": {"answer": schema(rng)}, "required": ["answer"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Answer with JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s, "strict": True}},
        temperature=1,
        seed=i,
        max_tokens=96,
    )
    c = r.choices[0]
    if c.finish_reason == "length":
        return "length"
    value = json.loads(c.message.content)
    try:
        jsonschema.validate(value, s)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"schema {json.dumps(s)}: {c.message.content!r}: {e.message}")
    return "valid"


outcomes = list(pool.map(constrained, range(n_schemas)))
valid = outcomes.count("valid")
assert valid >= n_schemas * 0.8, f"only {valid} of {n_schemas} finished within max_tokens"
print("OK schemas", valid, "valid,", outcomes.count("length"), "cut by max_tokens, 0 invalid")
