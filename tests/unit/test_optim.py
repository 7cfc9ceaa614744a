"""LAMB against a direct transcription of the paper's update (You et al., 2020, Algorithm 2,
with Adam's bias correction), on a toy problem; and it trains. The average of the weights
(train.ema) against its definition."""

from __future__ import annotations

import math

import pytest
import torch

from baton.optim import Averaged, Lamb, fitted
from baton.spec import spec_from_dict
from baton.training import make_optimizer


def transcription(params, grads, state, t, lr, b1, b2, eps, wd):
    """One LAMB step, tensor by tensor, as the paper writes it."""
    for i, (x, g) in enumerate(zip(params, grads)):
        m, v = state.setdefault(i, (torch.zeros_like(x), torch.zeros_like(x)))
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        state[i] = (m, v)
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        r = m_hat / (v_hat.sqrt() + eps)
        update = r + wd * x
        w_norm, u_norm = x.norm().item(), update.norm().item()
        trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        x -= lr * trust * update


def _problem(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(64, 8)
    y = (x[:, :3].sum(1, keepdim=True) - x[:, 5:6]).tanh()
    return model, x, y


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lamb_is_the_papers_update(wd):
    model, x, y = _problem()
    ref = [p.detach().clone() for p in model.parameters()]
    opt = Lamb(model.parameters(), lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=wd)
    state = {}
    for t in range(1, 11):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        transcription(ref, grads, state, t, 0.05, 0.9, 0.99, 1e-6, wd)
        for got, want in zip(model.parameters(), ref):
            # measured: at most 3.0e-08 apart in any step (foreach against per-tensor rounding)
            torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-6)
        # the next step's gradients are the optimizer's model's: the reference follows it
        ref = [p.detach().clone() for p in model.parameters()]


def test_a_tensor_of_zeros_takes_ratio_one_and_lamb_trains():
    model, x, y = _problem(1)
    with torch.no_grad():
        model[2].bias.zero_()  # ||x|| = 0: the step is Adam's
    opt = Lamb(model.parameters(), lr=0.02)
    losses = []
    for _ in range(200):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert model[2].bias.abs().sum() > 0 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.2 * losses[0], (losses[0], losses[-1])


def test_train_optimizer_picks_lamb_and_keeps_adamw_recipes():
    spec = spec_from_dict({"name": "t", "train": {"optimizer": "lamb"}})
    opt = make_optimizer(torch.nn.Linear(2, 2), spec.train)
    assert isinstance(opt, Lamb) and opt.param_groups[0]["weight_decay"] == spec.train.weight_decay
    plain = spec_from_dict({"name": "t"})
    assert "optimizer" not in plain.recipe()["train"]  # checkpoints of AdamW jobs still resume
    assert spec.recipe()["train"]["optimizer"] == "lamb"


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_the_average_is_its_definition_and_a_step_without_gradient_leaves_it(optimizer):
    """ema <- decay ema + (1 - decay) w after each step, from the weights before the first; a
    parameter with no gradient at a step keeps its average; an optimizer without train.ema
    loads a state less its averages, and the recipe ignores it (it changes no weight)."""
    spec = spec_from_dict({"name": "t", "train": {"optimizer": optimizer, "ema": 0.9, "lr": 0.1}})
    model, x, y = _problem(0)
    opt = make_optimizer(model, spec.train)
    assert isinstance(opt, Averaged)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(6):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == 3:
            model[0].bias.grad = None  # no gradient this step: neither the weight nor the average moves
        opt.step()
        for n, p in model.named_parameters():
            if not (step == 3 and n == "0.bias"):
                want[n] = 0.9 * want[n] + 0.1 * p.detach()
    for n, p in model.named_parameters():
        # measured: 1.2e-7 under both (float32: foreach lerp against the written-out sum)
        torch.testing.assert_close(opt.state[p]["ema"], want[n], rtol=0, atol=1e-6)
    state = opt.state_dict()
    without = spec_from_dict({"name": "t", "train": {"optimizer": optimizer, "lr": 0.1}})
    plain = make_optimizer(model, without.train)
    assert all("ema" not in s for s in fitted(plain, state)["state"].values())
    assert all("ema" in s for s in fitted(opt, state)["state"].values())
    assert spec.recipe() == without.recipe()
