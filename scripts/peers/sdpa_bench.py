"""PyTorch scaled_dot_product_attention on the decode shapes of kernels/benches/cuda_attention.rs,
with contiguous KV (the unpaged baseline the paged kernel is compared against).

Shapes: batch 64, one query token, context 2,048 and 16,384, 32 query heads / 8 KV heads, head dim
128, bf16. GQA through `enable_gqa=True` (PyTorch >= 2.5); older versions expand the KV heads
first (a copy, outside the timed region, so the time is for 32 KV heads: noted in the output).
Effective bandwidth counts the 8-head K and V bytes once, as the Rust bench does. Times are CUDA
events around ITERS back-to-back calls after 3 warm-up calls.

usage: python sdpa_bench.py [ITERS]   (prints one line per case; "skipped: ..." without a GPU)
"""
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # pragma: no cover
    print(f"skipped: {e}")
    sys.exit(0)

BATCH, HEADS, KV_HEADS, HEAD_DIM = 64, 32, 8, 128
ITERS = int(sys.argv[1]) if len(sys.argv) > 1 else 20


def timed(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / ITERS


def main():
    if not torch.cuda.is_available():
        print("skipped: torch sees no CUDA device")
        return
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, iters {ITERS}")
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * n / timed(lambda: dst.copy_(src))
    print(f"memcpy d2d: {copy / 1e9:.0f} GB/s (read + write, 1 GiB buffers)")
    del src, dst
    for ctx in (2048, 16384):
        q = torch.randn(BATCH, HEADS, 1, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(BATCH, KV_HEADS, ctx, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        note = "enable_gqa"
        try:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        except TypeError:
            rep = HEADS // KV_HEADS
            ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            fn = lambda: F.scaled_dot_product_attention(q, ke, ve)  # noqa: E731
            note = "KV heads expanded to 32 (no enable_gqa)"
        secs = timed(fn)
        kv_bytes = 2 * BATCH * ctx * KV_HEADS * HEAD_DIM * 2
        bw = kv_bytes / secs
        print(
            f"sdpa bf16 batch {BATCH} ctx {ctx} heads {HEADS}/{KV_HEADS} hd {HEAD_DIM} contiguous: "
            f"{secs * 1e6:.1f} us, {bw / 1e9:.0f} GB/s effective = {100 * bw / copy:.0f}% of memcpy "
            f"[{note}]"
        )
        del q, k, v


if __name__ == "__main__":
    main()
