# tiny.py with bf16 params and master_weights: the fp32 masters go to pinned host memory with the optimizer's
# states (12 bytes a param off the device instead of 8). The summary compares it with the recipe it reproduces:
# the same bf16 params with fp32 masters and states on the device. Run: python -m swapopt.train configs/tiny_masters.py
_base_ = ["./tiny.py"]  # mmengine inheritance: only the keys below change
model = dict(dtype="bfloat16")
# 16 chunks: a chunk carries 16 bytes a param (master, two moments, the upcast grad), so with tiny.py's 4 the
# staging would hold about as much as the masters take off the device
optim = dict(master_weights=True, swap_optimizer_times=16)
