# The resident baseline of tiny.py: same model, data and seed, optimizer states kept on the device.
# Its loss curve is bitwise identical to tiny.py's; its device-memory peak is what swapping saves against.
_base_ = ["./tiny.py"]  # mmengine inheritance: only the keys below change
optim = dict(swap_optimizer=False)
train = dict(compare_resident=0)
