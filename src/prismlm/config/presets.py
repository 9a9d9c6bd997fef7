"""Named presets: the starting points of ``RunConfig.from_name``."""

from __future__ import annotations


def _preset(model: dict, proto: dict | None, train: dict, data: dict | None = None, loss: dict | None = None) -> dict:
    m = dict(model)
    m["prototypes"] = proto
    return {"model": m, "train": train, "data": data or {}, "loss": loss or {}}


# Why these numbers: `tiny` is the test-suite size (d=32, 2 layers, K=64) that trains in seconds on one
# CPU core; `cpu-small` is the demo (d=128, 4 layers, K=512, k=8), the size at which the loss/coverage
# trade-off was measured on this kind of 2-core machine (shared/notes/objective-tradeoff.md); the GPT-2
# presets follow the GPT-2 family shapes with the paper's prototype banks (K=8,192 at 124M, 16,384 at 1.6B).
PRESETS: dict[str, dict] = {
    "tiny": _preset(
        dict(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=32),
        dict(num_prototypes=64, top_k=4),
        dict(batch_size=8, max_steps=50, lr=3e-3, warmup_steps=5, eval_interval=25, eval_batches=2, log_interval=5),
        dict(tokenizer="bpe-512"),
    ),
    "cpu-small": _preset(
        dict(vocab_size=8192, block_size=128, n_layer=4, n_head=4, n_embd=128),
        dict(num_prototypes=512, top_k=8),
        dict(batch_size=16, max_steps=600, lr=3e-3, warmup_steps=50, eval_interval=200, eval_batches=8),
        dict(tokenizer="bpe-8192"),
        dict(lambda_rec=1.0, lambda_r1=0.1, lambda_r2=0.1, warmup_steps=100),
    ),
    "gpt2-124m": _preset(
        dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
        dict(num_prototypes=8192, top_k=8),
        dict(
            batch_size=16, grad_accum=32, max_steps=20000, lr=6e-4, warmup_steps=700, eval_interval=500, eval_batches=50
        ),
        dict(tokenizer="gpt2"),
        dict(warmup_steps=1000),
    ),
    "gpt2-medium": _preset(
        dict(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
        dict(num_prototypes=8192, top_k=8),
        dict(
            batch_size=16,
            grad_accum=32,
            max_steps=40000,
            lr=3e-4,
            warmup_steps=700,
            eval_interval=1000,
            eval_batches=50,
        ),
        dict(tokenizer="gpt2"),
        dict(warmup_steps=1000),
    ),
    "gpt2-large": _preset(
        dict(vocab_size=50304, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
        dict(num_prototypes=16384, top_k=8),
        dict(
            batch_size=8,
            grad_accum=64,
            max_steps=60000,
            lr=2.5e-4,
            warmup_steps=700,
            eval_interval=1000,
            eval_batches=50,
            parallel="fsdp",
        ),
        dict(tokenizer="gpt2"),
        dict(warmup_steps=1000),
    ),
    "xl-1.6b": _preset(
        dict(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
        dict(num_prototypes=16384, top_k=8),
        dict(
            batch_size=8,
            grad_accum=64,
            max_steps=100000,
            lr=2e-4,
            warmup_steps=700,
            eval_interval=1000,
            eval_batches=50,
            parallel="fsdp",
        ),
        dict(tokenizer="gpt2"),
        dict(warmup_steps=1000),
    ),
}
