"""The swap knobs, declared once: ``SwapSettings`` (one SwapOptimizer's settings). ``SwapConfig``, the same
knobs plus the on/off switch for engine configs, is built on it in swapopt.switch.

Every other place that lists the knobs reads them from here: SwapOptimizer's keyword arguments, the class
forms' signatures (swapopt.classes), copies (swapopt.copying), the XTuner, Hugging Face and engine configs.
Adding a knob is adding a field below.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, field_validator, model_validator

from swapopt.resident_auto import parse_resident_mb

# A number of MiB, "auto" or "auto:F" (swapopt.resident_auto). A plain validator, so that a config copying this
# field (the XTuner integration's, annotated float) validates it the same way.
ResidentMB = Annotated[float | str, PlainValidator(parse_resident_mb)]


class SwapSettings(BaseModel):
    """The settings of one SwapOptimizer (immutable: a changed setting is a new optimizer)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    swap_optimizer_times: int = Field(default=16, ge=1)
    """About how many chunks the swapped states are split into per step, as a bound on a chunk's size. To avoid
    cutting params the planner may use chunks up to 25% larger or up to 1.5x as many; where the link's costs make
    smaller chunks faster, up to 8x as many; from 8 chunks on it adds up to 3 smaller first ones unless ``prefetch``
    is on (swapopt.plan)."""

    chunk_mb: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False)
    """Byte budget per chunk (MiB); overrides ``swap_optimizer_times`` when set."""

    slots: int = Field(default=3, ge=1)
    """Staging buffers on the device (3: one filling, one computing, one draining)."""

    resident_mb: ResidentMB = 0.0
    """States that fit this budget (MiB) stay on the device and are stepped first. ``"auto"``: the budget is
    measured at each step, what the device has spare at the forward/backward peak less a margin, and
    re-planned when that changes by more than 10%; ``"auto:F"`` keeps the share F (0 < F <= 0.9) of the spare
    memory instead of 0.9 (Note [resident auto] in swapopt.resident_auto). Not with ``master_weights``."""

    per_param: bool = False
    """Vouch that an optimizer from outside torch.optim keeps per-param state and reads no other param in
    its update (see swapopt.register_per_param); torch's own optimizers need no vouching."""

    overlap_forward: bool = False
    """Run the updates on their own stream and let the next forward start under them, each module waiting
    only for its own params (``attach(model)`` must be called; code reading params or states outside a
    forward calls ``wait_for_update()`` first)."""

    prefetch: bool = False
    """Swap in the first ``slots - 1`` chunks of the next step right after the forward, so they stream in
    under the backward and the first update starts at once (the forward hook comes with
    ``attach(model)``). Holds the staging (slots x slot bytes) from the forward to the end of step: a
    prefetch budget on top of the step's (slots + 1) x chunk."""

    master_weights: bool = False
    """Keep an fp32 master copy of each bf16/fp16 param in pinned host memory beside its states, and step
    the master (grad upcast to fp32) instead of the param, which receives the master rounded to its dtype:
    the mixed-precision recipe of Note [master weights] (swapopt.masters), with 12 bytes a param off the
    device instead of 8. fp32 params are their own masters."""

    step_graph: bool = False
    """Capture a swapped step once as a device graph (CUDA graphs, torch_npu's NPU graphs) and replay it at every
    later step whose plan, params, grads, states and hyperparameters are where they were: the step's host cost
    becomes one launch instead of about a dozen calls a chunk. The graph keeps the staging it was captured with
    ((slots + 1) x chunk at most) between steps. Adam-family optimizers need ``fused=True`` or ``capturable=True``
    (step counts on the device); a step that cannot be captured runs as usual, with a warning (Note [graphed
    step] in swapopt.graphed). Not with ``overlap_forward`` or ``prefetch``, whose work is spread over the
    forward."""

    @model_validator(mode="after")
    def _graph_is_one_step(self) -> "SwapSettings":
        if self.step_graph and (self.overlap_forward or self.prefetch):
            other = "overlap_forward" if self.overlap_forward else "prefetch"
            raise ValueError(
                f"step_graph cannot be combined with {other}: a graph replays one step() call, while {other} "
                "spreads the step's work over the forward"
            )
        return self

    @field_validator("swap_optimizer_times", "slots", mode="before")
    @classmethod
    def _a_count_not_a_switch(cls, value: object, info: Any) -> object:
        # pydantic turns True into 1: `swap_optimizer_times: true` (meant as the switch) would mean one chunk.
        if isinstance(value, bool):
            raise ValueError(
                f"{info.field_name} must be an int >= 1, got {value!r} (a count, not a switch; swap_optimizer "
                "is the on/off switch)"
            )
        if isinstance(value, float):  # 2.5 chunks: a mistake pydantic would round silently for 2.0 only
            raise ValueError(f"{info.field_name} must be an int >= 1, got {value!r}")
        return value


# The knobs by name, in declaration order (keyword arguments of SwapOptimizer and the class forms).
KNOBS: tuple[str, ...] = tuple(SwapSettings.model_fields)


def settings_from(knobs: dict[str, Any]) -> SwapSettings:
    """SwapSettings from keyword arguments, with errors that name the knob as the caller wrote it."""
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise TypeError(f"unknown swapopt knob(s) {', '.join(unknown)}; the knobs are: {', '.join(KNOBS)}")
    try:
        return SwapSettings(**knobs)
    except ValueError as err:  # pydantic's ValidationError: one line per bad knob
        lines = [
            (f"{'.'.join(map(str, e['loc']))}: " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
            for e in err.errors()
        ]
        raise ValueError("; ".join(lines)) from None
