# RL colocation: training shares the device with a rollout engine. Every rl.rollout_every steps the
# engine offloads the optimizer (a SwapOptimizer only drains in-flight copies and frees its staging
# buffers; its states already live on the host), a stand-in rollout holds rl.rollout_buffer_mb of device
# memory (KV cache, rollout batch), then the optimizer is onloaded and training goes on.
_base_ = ["./tiny.py"]
rl = dict(rollout_every=10, rollout_buffer_mb=8.0, empty_cache=True)
train = dict(steps=40, compare_resident=0)
