"""Python frames torch calls the simulator through on every op, kept cheap."""

from __future__ import annotations

from typing import Any


def skip_dynamo(code: Any) -> bool:
    """Have Dynamo leave frames of `code`, and every frame they call, alone, as torch.compile's disable(recursive=True)
    does, but decided once per code object instead of by a wrapper frame per call. torch wraps a dispatch mode's
    __torch_dispatch__ so (TorchDispatchMode.__init_subclass__), which costs two Python frames and four eval-frame
    switches per op; a mode whose code this marked answers False to _should_skip_dynamo instead. False where this
    torch has no such switch (the mode then keeps torch's wrapper)."""
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:
        return False
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    return True
