# The main job's default: a 0.47M-parameter byte-level LM on the shipped Shakespeare excerpt. On a machine
# without an accelerator it trains on the simulated device in about 15 s on 2 idle CPU cores.
# Run: python -m swapopt.train configs/tiny.py   (override keys with --cfg-options train.steps=20 ...)
model = dict(dim=128, n_layers=2, n_heads=4, max_seq_len=64)
data = dict(path=None)  # None: the corpus shipped in swapopt/engine/data
optim = dict(
    type="AdamW",
    lr=3e-3,
    betas=(0.9, 0.95),
    weight_decay=0.1,
    foreach=True,  # one multi-tensor kernel per chunk instead of one per parameter
    swap_optimizer=True,  # optimizer states live in pinned host memory, streamed through the device in step()
    # number of chunks the states are split into; these states are only 3.6 MB, and every chunk costs
    # kernel launches, so few chunks (use 16+ for GB-sized states: the tail copy is 1/times of the step)
    swap_optimizer_times=4,
    slots=3,  # staging buffers on the device: one filling, one computing, one draining
)
lr = dict(warmup_steps=10, min_lr_ratio=0.1)
train = dict(
    steps=60,
    batch=8,
    seq_len=64,
    seed=0,
    grad_clip=1.0,
    gradient_checkpointing=True,  # keeps activations small so optimizer states dominate device memory
    log_interval=10,
    compare_resident=3,  # then run 3 steps with swap_optimizer=False and print both device-memory peaks
)
