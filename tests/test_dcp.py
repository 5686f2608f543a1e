"""torch.distributed.checkpoint with a SwapOptimizer in one process (simulator active): save/load round
trip and async_save followed at once by a step."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import adamw, assert_same_state, make_model, snapshot, swap, train
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def app_state(model, opt):
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def resume(path, seed: int = 1):
    """A fresh model and optimizer (different init) loaded from ``path`` the DCP way."""
    model = make_model(seed)
    opt = swap(model)
    sd = app_state(model, opt)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    return model, opt


def test_save_load_resume_is_bitwise(sim, tmp_path):
    model = make_model()
    opt = swap(model)
    train(model, opt, 3)
    dcp.save(app_state(model, opt), checkpoint_id=tmp_path)
    train(model, opt, 2, start=3)

    model2, opt2 = resume(tmp_path)
    train(model2, opt2, 2, start=3)
    assert_same_state(snapshot(model, opt), snapshot(model2, opt2))


def test_async_save_then_step_saves_the_pre_step_state(sim, tmp_path, monkeypatch):
    model = make_model()
    opt = swap(model)
    train(model, opt, 3)
    expected = snapshot(model, opt)

    # Hold the file writes until the next step has run, so a checkpoint that still pointed at the live host
    # tensors would deterministically contain the post-step values.
    step_done = threading.Event()
    write_data = FileSystemWriter.write_data

    def delayed_write_data(self, *args, **kwargs):
        assert step_done.wait(timeout=60)
        return write_data(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", delayed_write_data)
    upload = dcp.async_save(app_state(model, opt), checkpoint_id=tmp_path)
    if hasattr(upload, "staging_completion"):  # an AsyncSaveResponse: staging must end before any step
        upload.staging_completion.result()
        upload = upload.upload_completion
    train(model, opt, 1, start=3)
    step_done.set()
    upload.result(timeout=60)

    after_step = snapshot(model, opt)
    assert not torch.equal(after_step["state"][0]["exp_avg"], expected["state"][0]["exp_avg"])
    model2, opt2 = resume(tmp_path)
    assert_same_state(expected, snapshot(model2, opt2))


def test_checkpoint_of_a_plain_optimizer_resumes_a_swap_optimizer(sim, tmp_path):
    model = make_model()
    plain = adamw(model)
    train(model, plain, 3)
    dcp.save(app_state(model, plain), checkpoint_id=tmp_path)
    train(model, plain, 2, start=3)

    model2, opt2 = resume(tmp_path)
    train(model2, opt2, 2, start=3)
    assert_same_state(snapshot(model, plain), snapshot(model2, opt2))


def test_swap_checkpoint_is_a_plain_dcp_checkpoint(sim, tmp_path):
    model = make_model()
    opt = swap(model)
    train(model, opt, 3)
    dcp.save(app_state(model, opt), checkpoint_id=tmp_path)

    model2 = make_model(1)
    plain = adamw(model2)
    sd = app_state(model2, plain)
    dcp.load(sd, checkpoint_id=tmp_path)
    set_model_state_dict(model2, sd["model"])
    set_optimizer_state_dict(model2, plain, sd["optim"])
    assert_same_state(snapshot(model, opt), snapshot(model2, plain))
