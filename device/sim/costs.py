"""Floating-point work of the aten ops whose time on an accelerator is bound by arithmetic, not by memory.

The timeline prices a kernel at max(bytes touched / memory bandwidth, FLOPs / peak rate). For element-wise
and reduction kernels the byte term always wins, so only the contractions carry a FLOP count here: the
matmul family (what `torch.matmul`, `F.linear` and `nn.Linear` reach at aten level), scaled dot-product
attention (the fused flash / memory-efficient / cuDNN / CPU-flash ops and their backward; the math fallback
reaches aten as bmm and is counted there) and convolution, forward and backward. Counts are from shapes
only, one multiply-add = 2 FLOPs, as datasheet peaks count them.

The peak that applies depends on the input dtype and, for float32, on whether torch would use TF32
tensor cores on CUDA: matmuls follow `torch.backends.cuda.matmul.fp32_precision` (or the legacy
`torch.get_float32_matmul_precision()`, "highest" by default: no TF32), convolutions follow
`torch.backends.cudnn.conv.fp32_precision` (or the legacy `torch.backends.cudnn.allow_tf32`, True by
default: TF32), mirroring what CUDA builds do with the same flags.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from device.sim.ops import _arg_names, _packets, arg_value


class Flops(NamedTuple):
    count: float  # floating-point operations
    precision: str  # peak to use: "bf16" | "fp16" | "tf32" | "fp32" | "fp64" (SimPreset.<precision>_tflops)


def _shape(t: Any) -> tuple[int, ...] | None:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _tf32_matmul() -> bool:
    new = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if new in ("tf32", "ieee"):
        return new == "tf32"
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # legacy and new flags mixed: torch refuses to answer, take its default (no TF32)
        return False


def _tf32_conv() -> bool:
    conv = getattr(torch.backends.cudnn, "conv", None)
    new = getattr(conv, "fp32_precision", "none")
    if new in ("tf32", "ieee"):
        return new == "tf32"
    return bool(torch.backends.cudnn.allow_tf32)


def _priced(count: float, dtype: torch.dtype, tf32: Callable[[], bool]) -> Flops | None:
    """Attach the precision whose peak applies; None for dtypes without a FLOP peak here (integers, fp8)."""
    if dtype.is_complex:
        # A complex multiply-add is four real ones in the component dtype.
        count, dtype = 4 * count, dtype.to_real()
    if dtype is torch.bfloat16:
        return Flops(count, "bf16")
    if dtype is torch.float16:
        return Flops(count, "fp16")
    if dtype is torch.float32:
        return Flops(count, "tf32" if tf32() else "fp32")
    if dtype is torch.float64:
        return Flops(count, "fp64")
    return None


def _by_packet(by_name: dict[str, Any]) -> dict[Any, Any]:
    """The same table keyed by aten op packet, for the ops this torch version has."""
    return {p: value for name, value in by_name.items() if (p := getattr(torch.ops.aten, name, None)) is not None}


def _matmul_dims(a: Sequence[int], b: Sequence[int]) -> float:
    """Multiply-adds of torch.matmul(a, b) with its 1-D promotion and batch broadcasting."""
    a2 = (1, *a) if len(a) == 1 else tuple(a)
    b2 = (*b, 1) if len(b) == 1 else tuple(b)
    # No batch dims (mm, addmm, mv): nothing to broadcast (torch.broadcast_shapes costs microseconds per op).
    batch = torch.broadcast_shapes(a2[:-2], b2[:-2]) if len(a2) > 2 or len(b2) > 2 else ()
    return math.prod(batch) * a2[-2] * a2[-1] * b2[-1]


# id(op) -> (op, its two operands' positions and names, whether it is linear): what _mm looks up, once per op
# (an op's packet is a Python property and hashes in Python). The op is kept so that its id stays its own.
_MM_OPS: dict[int, tuple[Any, int, int, str, str, bool]] = {}


def _mm(func: Any, args: tuple, kwargs: dict) -> Flops | None:
    known = _MM_OPS.get(id(func))
    if known is None:
        packet = func.overloadpacket
        first, second = _MM_OPERANDS[packet]
        names = _arg_names(func)
        known = (func, names.index(first), names.index(second), first, second, packet is torch.ops.aten.linear)
        _MM_OPS[id(func)] = known
    _, i, j, first, second, linear = known
    n = len(args)
    # arg_value and _shape, written out
    a = args[i] if i < n else kwargs.get(first)
    b = args[j] if j < n else kwargs.get(second)
    sa = tuple(a.shape) if isinstance(a, torch.Tensor) else None
    sb = tuple(b.shape) if isinstance(b, torch.Tensor) else None
    if sa is None or sb is None or not sa or not sb:
        return None
    if linear:  # weight is (out, in): input @ weight.T
        macs = math.prod(sa) * sb[0] if len(sb) == 2 else math.prod(sa)
    else:  # addbmm sums its batch into one matrix: the work is still the bmm's
        macs = _matmul_dims(sa, sb)
    return _priced(2.0 * macs, a.dtype, _tf32_matmul)


# packet -> the argument names of its two matrix operands
_MM_OPERANDS: dict[Any, tuple[str, str]] = _by_packet(
    {
        "mm": ("self", "mat2"),
        "addmm": ("mat1", "mat2"),
        "_addmm_activation": ("mat1", "mat2"),
        "bmm": ("self", "mat2"),
        "baddbmm": ("batch1", "batch2"),
        "addbmm": ("batch1", "batch2"),
        "mv": ("self", "vec"),
        "addmv": ("mat", "vec"),
        "dot": ("self", "tensor"),
        "vdot": ("self", "other"),
        "matmul": ("self", "other"),
        "linear": ("input", "weight"),
    }
)


def _causal_fraction(q_len: int, k_len: int, bottom_right: bool) -> float:
    """Share of the L x S score matrix a causal mask keeps (fused kernels skip the masked tiles).
    Top-left alignment keeps key j for query i when j <= i; bottom-right when j <= i + S - L. Row i keeps
    clamp(i + shift + 1, 0, S) keys; summed in closed form."""
    shift = k_len - q_len if bottom_right else 0
    first = min(max(0, -shift), q_len)  # rows before this keep nothing
    full = min(max(first, k_len - shift - 1), q_len)  # rows from this on keep every key
    ramp = (first + full + 2 * shift + 1) * (full - first) // 2  # sum of i + shift + 1 over [first, full)
    return (ramp + (q_len - full) * k_len) / (q_len * k_len)


def _attention(func: Any, args: tuple, kwargs: dict) -> Flops | None:
    packet = func.overloadpacket
    backward, heads_second = _ATTENTION[packet]
    q = arg_value(func, args, kwargs, "query")
    k = arg_value(func, args, kwargs, "key")
    v = arg_value(func, args, kwargs, "value")
    sq, sk, sv = _shape(q), _shape(k), _shape(v)
    if sq is None or sk is None or sv is None or len(sq) != 4 or len(sk) != 4 or len(sv) != 4:
        return None
    if heads_second:  # (batch, heads, seq, dim)
        batch, heads, q_len, dim = sq
        k_len, v_dim = sk[2], sv[3]
    else:  # (batch, seq, heads, dim): the lower-level flash / efficient kernels
        batch, q_len, heads, dim = sq
        k_len, v_dim = sk[1], sv[3]
    if q_len == 0 or k_len == 0:
        return None
    mask_type = arg_value(func, args, kwargs, "custom_mask_type")
    if mask_type is not None:  # efficient-attention kernels: 0 none, 1 causal top-left, 2 causal bottom-right
        causal, bottom_right = bool(mask_type), mask_type == 2
    else:
        causal, bottom_right = bool(arg_value(func, args, kwargs, "is_causal", False)), False
    pairs = batch * heads * q_len * k_len * (_causal_fraction(q_len, k_len, bottom_right) if causal else 1.0)
    # Forward: S = Q K^T and O = P V. Backward recomputes S, then dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q.
    macs = pairs * (3 * dim + 2 * v_dim) if backward else pairs * (dim + v_dim)
    return _priced(2.0 * macs, q.dtype, _tf32_matmul)


# packet -> (is a backward op, layout is (batch, heads, seq, dim))
_ATTENTION: dict[Any, tuple[bool, bool]] = _by_packet(
    {
        "_scaled_dot_product_flash_attention_for_cpu": (False, True),
        "_scaled_dot_product_flash_attention_for_cpu_backward": (True, True),
        "_scaled_dot_product_flash_attention": (False, True),
        "_scaled_dot_product_flash_attention_backward": (True, True),
        "_scaled_dot_product_efficient_attention": (False, True),
        "_scaled_dot_product_efficient_attention_backward": (True, True),
        "_scaled_dot_product_cudnn_attention": (False, True),
        "_scaled_dot_product_cudnn_attention_backward": (True, True),
        "_flash_attention_forward": (False, False),
        "_flash_attention_backward": (True, False),
        "_efficient_attention_forward": (False, False),
        "_efficient_attention_backward": (True, False),
    }
)


def _conv_macs(weight: Sequence[int], batch: int, spatial: Sequence[int]) -> float:
    """Multiply-adds of a convolution whose weight is (A, B, *kernel) swept over `spatial` positions: each
    position does A x B x kernel of them (A, B = out, in/groups; transposed: in, out/groups)."""
    return batch * math.prod(spatial) * math.prod(weight)


def _conv_out(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _convolution(func: Any, args: tuple, kwargs: dict) -> Flops | None:
    packet = func.overloadpacket
    weight = arg_value(func, args, kwargs, "weight")
    transposed = bool(arg_value(func, args, kwargs, "transposed", False))
    sw = _shape(weight)
    if sw is None or len(sw) < 3:
        return None
    if packet is torch.ops.aten.convolution_backward:
        grad_out = _shape(arg_value(func, args, kwargs, "grad_output"))
        inp = _shape(arg_value(func, args, kwargs, "input"))
        mask = arg_value(func, args, kwargs, "output_mask") or (True, True, True)
        if grad_out is None or inp is None:
            return None
        # The forward swept the weight over the output positions (input positions when transposed).
        forward = _conv_macs(sw, inp[0], inp[2:] if transposed else grad_out[2:])
        # grad_input and grad_weight each cost one forward; grad_bias is a reduction, bytes-bound.
        macs = forward * (int(bool(mask[0])) + int(bool(mask[1])))
    else:
        inp = _shape(arg_value(func, args, kwargs, "input"))
        if inp is None or len(inp) != len(sw):
            return None
        if transposed:
            spatial: Sequence[int] = inp[2:]
        else:
            n = len(sw) - 2
            stride, padding, dilation = (
                _per_dim(arg_value(func, args, kwargs, key), n, default)
                for key, default in (("stride", 1), ("padding", 0), ("dilation", 1))
            )
            spatial = [_conv_out(*dims) for dims in zip(inp[2:], sw[2:], stride, padding, dilation)]
        macs = _conv_macs(sw, inp[0], spatial)
    if macs <= 0:
        return None
    return _priced(2.0 * macs, weight.dtype, _tf32_conv)


def _per_dim(value: Any, n: int, default: int) -> list[int]:
    if value is None:
        return [default] * n
    if isinstance(value, int):
        return [value] * n
    values = list(value)
    return values * n if len(values) == 1 else values


_CONVOLUTION = _packets("convolution", "_convolution", "convolution_backward")


def priced_by_flops(func: Any) -> bool:
    """Whether op_flops can give `func` a count (else it is None for every call)."""
    return flops_counter(func) is not None


def flops_counter(func: Any) -> Callable[[Any, tuple, dict], Flops | None] | None:
    """What op_flops calls for `func` (None: it has no count), for a caller that asks once per op."""
    packet = getattr(func, "overloadpacket", None)
    if packet in _MM_OPERANDS:
        return _mm
    if packet in _ATTENTION:
        return _attention
    if packet in _CONVOLUTION:
        return _convolution
    return None


def op_flops(func: Any, args: tuple, kwargs: dict) -> Flops | None:
    """FLOPs and the precision whose peak prices them, for ops bound by arithmetic; None for all others
    (their time is their bytes). Cheap for the common case: one dictionary lookup."""
    counter = flops_counter(func)
    return None if counter is None else counter(func, args, kwargs)
