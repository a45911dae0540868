"""Writes F32, F16 and Q8_0 GGUF copies of a quantized GGUF with the `gguf` package: every tensor
is dequantized and written at the new precision (Q8_0: the matrices quantized with gguf's reference
quantizer, vectors kept f32), every metadata key copied. This is how the llama.cpp peer runs at the
same precision as kvgate (llama.cpp's own converter needs torch).

usage: python gguf_convert.py IN.gguf OUT_PREFIX   -> OUT_PREFIX.{f32,f16,q8_0}.gguf
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize


def copy_metadata(reader, writer):
    for field in reader.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name in ("general.architecture",):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == GGUFValueType.STRING:
                value = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
            else:
                value = [field.parts[i][0].item() for i in field.data]
            writer.add_array(name, value)
        elif vtype == GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8", "replace"))
        else:
            writer.add_key_value(name, field.parts[field.data[0]][0].item(), vtype)


def convert(src, dst, dtype):
    reader = GGUFReader(src)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = GGUFWriter(dst, arch)
    copy_metadata(reader, writer)
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))
        data = np.asarray(data, dtype=np.float32).reshape(shape)
        if dtype == "f16" and len(shape) > 1:
            data = data.astype(np.float16)
        if dtype == "q8_0" and len(shape) > 1:
            q = quantize(data, GGMLQuantizationType.Q8_0)
            writer.add_tensor(t.name, q, raw_dtype=GGMLQuantizationType.Q8_0)
            continue
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    src, prefix = sys.argv[1], sys.argv[2]
    for dtype in ("f32", "f16", "q8_0"):
        convert(src, f"{prefix}.{dtype}.gguf", dtype)
        print(f"wrote {prefix}.{dtype}.gguf")
