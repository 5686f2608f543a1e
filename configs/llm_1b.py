# A 1.0B-parameter decoder-only LM for GPUs/NPUs (byte-level, so it runs on the shipped corpus; point
# model.hf_path at a local Hugging Face checkpoint to train that instead). fp32 master weights and grads
# stay on the device (8 GB); the 8 GB of AdamW states live in pinned host memory and stream through in
# 16 chunks per step. Single device: python -m swapopt.train configs/llm_1b.py
# 8 devices, FSDP2 with bf16 compute: torchrun --nproc-per-node 8 -m swapopt.train configs/llm_1b.py
# Without a GPU/NPU it runs on the simulator, where device memory is host memory: the full size needs about
# 20 GB of host RAM and minutes per step (the job prints its estimate first and refuses what will not fit;
# train.host_ram_check=false overrides). The same architecture scaled down runs in a few minutes on 2 cores:
#   python -m swapopt.train configs/llm_1b.py --cfg-options model.dim=512 model.n_heads=8 model.ffn_dim=1408 \
#       model.n_layers=4 train.seq_len=128 train.steps=20 train.checkpoint_interval=10
model = dict(dim=2048, n_layers=20, n_heads=16, ffn_dim=5632, max_seq_len=2048)
data = dict(path=None)
optim = dict(
    type="AdamW",
    lr=3e-4,
    betas=(0.9, 0.95),
    weight_decay=0.1,
    fused=None,  # torch picks its default kernel; results are bitwise those of the unswapped optimizer
    swap_optimizer=True,
    swap_optimizer_times=16,
    slots=3,
)
lr = dict(warmup_steps=100, min_lr_ratio=0.1)
train = dict(
    steps=1000,
    batch=4,
    seq_len=2048,
    seed=0,
    grad_clip=1.0,
    gradient_checkpointing=True,
    checkpoint_dir="work_dirs/llm_1b",
    checkpoint_interval=200,
    metrics_path="work_dirs/llm_1b/metrics.jsonl",
    log_interval=10,
    sim_preset="h100",  # without an accelerator the simulator stands in (slow on CPU: see the overrides above)
)
