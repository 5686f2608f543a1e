"""XTuner v1 under the simulator, as a program of its own: XTuner is imported as it would be on a CUDA machine (the
cuda flavour, SWAPOPT_DEVICE=sim) or an Ascend one (the npu flavour, SWAPOPT_SIM_PRESET=910b), after the device is
up, with nothing patched. tests/test_xtuner_engine_cuda.py and tests/test_xtuner_npu.py start it.

Usage: xtuner_engine_job.py MODE DIR
- ``configs``: needs XTuner's config package. XTuner's own AdamWConfig builds its SwapAdamW and, after use_swapopt(),
  swapopt; both train the stand-in engine (tests/xtuner_standin.py) bitwise like XTuner's plain AdamW.
- ``engine``: needs XTuner's model package (ray; MindSpeed on npu; triton and pkg_resources on cuda:
  tests/xtuner_real.py). XTuner's TrainEngine (FSDP2 over one gloo rank) trains a tiny dense Qwen3 three steps with
  plain AdamW, XTuner's SwapAdamW and swapopt: the same losses and params, bit for bit. On npu with XTuner's npu
  kernels (torch_npu's rms_norm, rotary_mul and fusion attention in the TND layout); on cuda with the kernels XTuner
  picks there that are torch ops (its native rms_norm and rotary embedding, eager attention: see _cuda_model_kernels),
  and no Triton kernel launched. Saves plain AdamW's losses and params to DIR/plain-FLAVOUR.pt.
- ``plain``: ``engine``'s plain AdamW run only, for the same job on the CPU (SWAPOPT_DEVICE=cpu: XTuner resolves
  cpu and picks the same torch ops as on cuda).
Prints ``ok MODE`` last on success.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import xtuner_real  # noqa: F401  (puts the checkouts named by SWAPOPT_XTUNER_SRC / SWAPOPT_MINDSPEED_SRC on sys.path)

import device
from swapopt import SwapOptimizer
from swapopt.integrations.xtuner import use_swapopt

CFG = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, foreach=True)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _host_states(opt: torch.optim.Optimizer) -> int:
    """Moment states held in host memory (what a swapping optimizer keeps there between steps)."""
    held = 0
    for st in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            value = st.get(key)
            if isinstance(value, torch.Tensor):
                assert device.is_host_tensor(value), key
                held += 1
    return held


def configs() -> None:
    from test_integration_xtuner import snapshot
    from xtuner.v1.config import AdamWConfig
    from xtuner.v1.optim import swap_adamw
    from xtuner_standin import TrainEngine, train

    def params_and_moments(engine: TrainEngine) -> dict:
        out = snapshot(engine)
        kept = {k: v for k, v in out.items() if k.startswith("param.") or k.rsplit(".", 1)[1] in ("exp_avg", "exp_avg_sq")}
        return {k: v.cpu() for k, v in kept.items()}

    assert swap_adamw.DEVICE == _flavour()  # XTuner's optimizer module resolved its device at import
    plain = TrainEngine(AdamWConfig(**CFG))
    train(plain, 0, 3)
    expected = params_and_moments(plain)

    own = TrainEngine(AdamWConfig(**CFG, swap_optimizer=True))
    assert type(own.optimizer) is swap_adamw.SwapAdamW
    train(own, 0, 3)
    assert _host_states(own.optimizer)
    _same(params_and_moments(own), expected)

    engine_cls = type("TrainEngine", (TrainEngine,), {})
    use_swapopt(AdamWConfig, engine_cls=engine_cls)
    swapped = engine_cls(AdamWConfig(**CFG, swap_optimizer=True, swap_optimizer_times=3))
    assert isinstance(swapped.optimizer, SwapOptimizer)
    train(swapped, 0, 3)
    assert swapped.optimizer.swap_stats().h2d_bytes > 0 and _host_states(swapped.optimizer)
    _same(params_and_moments(swapped), expected)


def engine(out_dir: Path, plain_only: bool = False) -> None:
    from xtuner.v1.config import AdamWConfig, FSDPConfig
    from xtuner.v1.data_proto import SequenceContext
    from xtuner.v1.engine.train_engine import TrainEngine
    from xtuner.v1.loss.ce_loss import CELossConfig
    from xtuner.v1.model.base import ModelItem
    from xtuner.v1.model.dense.qwen3 import Qwen3DenseConfig
    from xtuner.v1.module.attention import MHAConfig
    from xtuner.v1.module.rope import RopeParametersConfig
    from xtuner.v1.ops import flash_attn_varlen_func, rms_norm
    from xtuner.v1.optim import swap_adamw
    from xtuner.v1.utils.device import get_device

    flavour = _flavour()
    if flavour == "npu":
        # XTuner chose its npu kernels at import: they reach the simulated torch_npu.
        assert (rms_norm.__name__, flash_attn_varlen_func.__name__) == ("npu_rms_norm", "npu_flash_varlen_attn")
        attention = {}  # XTuner's default, flash attention (torch_npu's npu_fusion_attention)
        launches = None
    else:  # cuda, and the CPU (XTuner picks the same torch ops there)
        attention = _cuda_model_kernels(rms_norm)
        launches = _count_triton_launches() if flavour == "cuda" else None
    # tests/xtuner_moe.py's tiny Qwen3, dense.
    model_cfg = Qwen3DenseConfig(
        vocab_size=64, max_position_embeddings=128, pad_token_id=None, bos_token_id=0, eos_token_id=1,
        num_hidden_layers=2, max_window_layers=2, hidden_size=32, intermediate_size=64, rms_norm_eps=1e-6,
        rope_parameters_cfg=RopeParametersConfig(rope_theta=1e6), hidden_act="silu",
        attention=MHAConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True, **attention),
        tie_word_embeddings=False, compile_cfg=False,
    )  # fmt: skip
    loss_cfg = CELossConfig()
    assert loss_cfg.mode == "eager"  # not liger, XTuner's Triton loss on cuda

    def run(optim_cfg: AdamWConfig) -> tuple[TrainEngine, dict]:
        torch.manual_seed(0)
        engine = TrainEngine(model_cfg=model_cfg, optim_cfg=optim_cfg, fsdp_cfg=FSDPConfig(torch_compile=False))
        engine.init_model_weights()
        assert next(engine.model.parameters()).device == device.torch_device()  # sim:0 on cuda, npu:0 on npu
        if flavour != "npu":
            from xtuner.v1.ops.attn_imp import eager_attention

            attn = [m.attn_impl_func for m in engine.model.modules() if hasattr(m, "attn_impl_func")]
            assert len(attn) == 2 and all(f is eager_attention for f in attn), attn
        out = {}
        for step in range(3):
            ids = torch.randint(0, 64, (1, 33), generator=torch.Generator().manual_seed(step), device="cpu")
            seq_ctx = SequenceContext.from_input_ids((ids[:, :-1],), device=get_device())
            loss_ctx = loss_cfg.build(data={"shifted_labels": ids[:, 1:].to(get_device())}, sp_mesh=None)
            loss_ctx = loss_cfg.loss_ctx_cls.build_batches([loss_ctx])[0]
            info = engine.train_step([ModelItem(seq_ctx=seq_ctx, loss_ctx={"lm": loss_ctx})])
            engine.step_optimizer(engine.clip_grad_norm())
            out[f"loss.{step}"] = torch.tensor(info["total_loss"], dtype=torch.float64)
        out.update({f"param.{n}": p.full_tensor().cpu() for n, p in engine.model.named_parameters()})
        return engine, out

    _, expected = run(AdamWConfig(**CFG))
    assert torch.isfinite(expected["loss.0"]) and not torch.equal(expected["loss.0"], expected["loss.2"])
    torch.save(expected, out_dir / f"plain-{flavour}.pt")  # for a comparison across processes (the CPU's run)
    if plain_only:
        return

    own, got = run(AdamWConfig(**CFG, swap_optimizer=True))
    assert type(own.optimizer) is swap_adamw.SwapAdamW and _host_states(own.optimizer)
    _same(got, expected)

    use_swapopt()  # XTuner's own AdamWConfig and TrainEngine
    swapped, got = run(AdamWConfig(**CFG, swap_optimizer=True, swap_optimizer_times=3))
    assert isinstance(swapped.optimizer, SwapOptimizer)
    assert swapped.optimizer.swap_stats().h2d_bytes > 0 and _host_states(swapped.optimizer)
    _same(got, expected)
    if launches is not None:
        assert launches == [], launches  # the simulator has no GPU to run them: none was launched


def _flavour() -> str:
    """The device type frameworks see: cuda or npu under the simulator (its flavour), cpu with SWAPOPT_DEVICE=cpu."""
    return device.get_device()


def _cuda_model_kernels(rms_norm) -> dict:
    """What XTuner's cuda path runs in this model, checked, and the attention config that keeps it on torch ops.

    XTuner resolves its cuda kernels at import. rms_norm: its native one (F.rms_norm) unless
    XTUNER_USE_NATIVE_RMSNORM=0 asks for its Triton kernel (xtuner/v1/ops/rms_norm/__init__.py). Rotary embedding:
    plain torch ops (apply_rotary_pos_emb_cuda). Attention: the default, flash attention, needs the flash-attn
    package's CUDA kernels, and without flash-attn MHAConfig switches to flex attention (xtuner/v1/module/attention/
    mha.py), which torch.compile turns into Triton kernels; `attn_impl="eager_attention"`, one of XTuner's three
    attention choices, computes attention with matmul and softmax, so no compiled or Triton kernel runs. Loss:
    CELossConfig's default mode, eager (liger is Triton)."""
    import xtuner.v1.ops.rotary_emb as rotary

    assert rms_norm.__name__ == "native_rms_norm", rms_norm
    assert rotary.get_apply_rotary_emb() is rotary.apply_rotary_pos_emb_cuda
    return {"attn_impl": "eager_attention"}


def _count_triton_launches() -> list[str]:
    """Record every Triton kernel launched from now on (a list that fills as they launch).

    XTuner's cuda modules import Triton and define their kernels at import; a launch goes through
    JITFunction.run (and, for autotuned kernels, Autotuner.run before it). The simulator has no GPU for one to
    run on, so the job asserts the list stays empty rather than waiting for Triton's driver to fail."""
    from triton.runtime import autotuner, jit

    launched: list[str] = []
    for owner in (jit.JITFunction, autotuner.Autotuner):
        original = owner.run

        def run(self, *args, _original=original, **kwargs):
            launched.append(getattr(getattr(self, "fn", self), "__name__", repr(self)))
            return _original(self, *args, **kwargs)

        owner.run = run
    return launched


def main() -> None:
    device.get_torch_device_module()  # the process-wide simulator (SWAPOPT_DEVICE=sim) is up before XTuner is imported
    from xtuner.v1.utils.device import get_device

    mode, out = sys.argv[1], Path(sys.argv[2])
    assert get_device() == _flavour(), get_device()  # XTuner's own check, unpatched (cpu without a simulator)
    dist.init_process_group("gloo", init_method=f"file://{out / 'pg'}", rank=0, world_size=1)
    try:
        if mode == "configs":
            configs()
        else:
            engine(out, plain_only=mode == "plain")
    finally:
        dist.destroy_process_group()
    print("ok", mode)


if __name__ == "__main__":
    main()
