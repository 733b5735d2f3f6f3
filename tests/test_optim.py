import pytest
import torch

from conftest import small_config
from loom.models.llama import build_model
from loom.train.optim import AdamWLowPrecisionState, build_optimizer, state_bytes_per_param


def _train(opt_factory, steps=5, seed=0):
    torch.manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(64, 32))
    opt = opt_factory([w])
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i)
        w.grad = torch.randn(64, 32, generator=g)
        opt.step()
    return w.detach(), opt


def test_low_precision_adamw_in_fp32_equals_torch_adamw():
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours, _ = _train(lambda p: AdamWLowPrecisionState(p, state_dtype=torch.float32, **kw))
    ref, _ = _train(lambda p: torch.optim.AdamW(p, **kw))
    assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-7)


def test_bf16_moments_are_stored_in_bf16_and_stay_close():
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours, opt = _train(lambda p: AdamWLowPrecisionState(p, state_dtype=torch.bfloat16, **kw))
    ref, _ = _train(lambda p: torch.optim.AdamW(p, **kw))
    state = next(iter(opt.state.values()))
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
    moved = (ref - _train(lambda p: torch.optim.SGD(p, lr=0.0))[0]).abs().mean()
    assert (ours - ref).abs().mean() < 0.02 * moved  # bf16 storage changes the updates by ~1%


@pytest.mark.parametrize("state_dtype, expected", [("float32", 16.0), ("bfloat16", 12.0)])
def test_bytes_per_parameter(state_dtype, expected):
    cfg = small_config(f"optim.state_dtype={state_dtype}")
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.optim)
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    model(x).float().logsumexp(-1).mean().backward()
    opt.step()
    got = state_bytes_per_param(model, opt)
    assert got["params"] == 4.0 and got["grads"] == 4.0
    assert got["total"] == expected


def test_bf16_moments_stay_bf16_after_loading_a_state_dict():
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    _, opt = _train(lambda p: AdamWLowPrecisionState(p, **kw))
    sd = opt.state_dict()
    w = torch.nn.Parameter(torch.zeros(64, 32))
    fresh = AdamWLowPrecisionState([w], **kw)
    fresh.load_state_dict(sd)
    state = next(iter(fresh.state.values()))
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_one_optimizer_state_formula_is_what_adamw_holds(state_dtype):
    """adam_moment_bytes is the bytes per trained parameter the optimizer really holds after a step, and what
    `loom memory`, the banner's LoRA line and the planner's memory all count (one formula, not four)."""
    from loom.memory import state_bytes
    from loom.planner.hardware import load_gpu
    from loom.planner.memory import memory
    from loom.planner.workload import Layout, Workload
    from loom.rules import adam_moment_bytes, lora_bytes_per_param

    cfg = small_config(f"optim.state_dtype={state_dtype}")
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.optim)
    model(torch.randint(0, cfg.model.vocab_size, (2, 16))).float().logsumexp(-1).mean().backward()
    opt.step()
    held = state_bytes_per_param(model, opt)["optimizer"]
    assert held == adam_moment_bytes(state_dtype) == (8 if state_dtype == "float32" else 4)
    estimate = state_bytes(cfg)
    assert estimate["optimizer_bytes"] == held * estimate["trained_params_per_rank"]
    assert lora_bytes_per_param(cfg.train.dtype, state_dtype)[1] == 4 + 4 + held
    w = Workload(cfg.model, cfg.train.seq_len, 8, 1, load_gpu("h100"), state_dtype=state_dtype)
    planned = memory(w, Layout(micro_batch=4))
    assert planned["optimizer"] == pytest.approx(held * planned["params"] / 4, rel=1e-9)
