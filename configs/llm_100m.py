# A 99.5M-parameter decoder-only LM (byte-level, GPT-2-small width) for the end-to-end benchmark of
# overlap_forward: at 8 x 1024 tokens per step its forward takes about as long as streaming its 0.8 GB of
# AdamW states through the device each way, the regime where the swap step can hide under the next forward.
# Single device: python -m swapopt.train configs/llm_100m.py
# Benchmark: python -m swapopt.bench --sizes none --e2e llm_100m
# On the simulator (no GPU/NPU) one step costs about 5 TFLOP of real CPU work: minutes per step on 2 cores.
model = dict(dim=768, n_layers=14, n_heads=12, ffn_dim=2048, max_seq_len=1024)
data = dict(path=None)
optim = dict(
    type="AdamW",
    lr=6e-4,
    betas=(0.9, 0.95),
    weight_decay=0.1,
    fused=None,
    swap_optimizer=True,
    swap_optimizer_times=16,
    slots=3,
    overlap_forward=True,  # the update of step N streams under the forward of step N + 1
    prefetch=True,  # the first chunks of step N stream in under its backward
)
lr = dict(warmup_steps=100, min_lr_ratio=0.1)
train = dict(
    steps=1000,
    batch=8,
    seq_len=1024,
    seed=0,
    grad_clip=1.0,
    gradient_checkpointing=False,
    log_interval=10,
    sim_preset="h100",
)
