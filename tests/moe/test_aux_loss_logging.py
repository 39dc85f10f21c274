"""The logged aux losses: per MoE layer, each the micro-batch's loss averaged over the step's
micro-batches, as megatron-core's functions compute it from the router's logits; the same on
a layout that splits each sequence over ranks (the ranks' parts add up)."""

import pytest
import torch

from megatron_ul.training import loop
from megatron_ul.training.pretrain import configure, setup
from tests.distributed import run_distributed
from tests.training.equivalence import BASE, LLAMA_GQA

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

ARGV = BASE + LLAMA_GQA
ARGV += ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
ARGV += ["--train-iters", "1", "--lr-warmup-iters", "0", "--global-batch-size", "4"]


def _train(rank, world, argv):
    reports, logits = [], {}
    original = loop.aux_loss_report

    def recorded(*args):
        reports.append(original(*args))
        return reports[-1]

    loop.aux_loss_report = recorded
    trainer = setup(configure(argv, world))
    routers = [m for m in trainer.model.modules() if type(m).__name__ == "TopKRouter"]
    for n, router in enumerate(routers):
        logits[n] = []
        router.register_forward_hook(
            lambda mod, inputs, _out, n=n: logits[n].append((inputs[0] @ mod.weight.t()).detach())
        )
    trainer.train()
    return reports, logits


def test_logged_aux_losses_are_megatron_cores_per_layer_on_any_layout():
    ((reports, logits),) = run_distributed(_train, 1, ARGV)
    report = reports[-1]
    assert len(logits) == 2 and all(len(v) == 2 for v in logits.values())  # 2 micro-batches
    for layer, per_micro_batch in logits.items():
        balance, z = [], []
        for lg in per_micro_batch:
            lg = lg.double()
            scores = torch.softmax(lg, -1)
            counts = torch.zeros_like(scores).scatter(1, scores.topk(2, 1).indices, 1.0).sum(0)
            balance.append(
                moe_utils.switch_load_balancing_loss_func(scores, counts, lg.shape[0], 2, 4, 1.0)
            )
            z.append(moe_utils.z_loss_func(lg, 1.0))
        n = layer + 1
        got = report[f"moe/load_balancing_loss_layer_{n}"]
        assert got == pytest.approx(float(sum(balance) / 2), rel=1e-5)
        assert report[f"moe/z_loss_layer_{n}"] == pytest.approx(float(sum(z) / 2), rel=1e-5)
    mean = (
        report["moe/load_balancing_loss_layer_1"] + report["moe/load_balancing_loss_layer_2"]
    ) / 2
    assert report["moe/load_balancing_loss"] == pytest.approx(mean)
    # Sequences split over two ranks (Ulysses, EP 2): the ranks' parts add up to the same.
    split = run_distributed(
        _train, 2, ARGV + ["--ds-sequence-parallel-size", "2", "--expert-model-parallel-size", "2"]
    )
    for rank_reports, _ in split:
        for key, value in report.items():
            assert rank_reports[-1][key] == pytest.approx(value, rel=1e-5), key


def _router_gradients(rank, world, argv):
    """The router weights before the step, their inputs per micro-batch and the gradient
    backward gave them over the step (summed over micro-batches, before clipping)."""
    trainer = setup(configure(argv, world))
    routers = [m for m in trainer.model.modules() if type(m).__name__ == "TopKRouter"]
    weights = [r.weight.detach().clone() for r in routers]
    inputs = [[] for _ in routers]
    grads = [torch.zeros_like(w) for w in weights]
    for n, router in enumerate(routers):
        router.register_forward_hook(lambda _m, i, _o, n=n: inputs[n].append(i[0].detach()))
        router.weight.register_hook(lambda g, n=n: grads[n].add_(g))
    trainer.train()
    return weights, inputs, grads


def test_aux_loss_gradient_is_the_mean_over_micro_batches():
    """Megatron's weighting: the load-balancing loss adds coeff × (1/M) Σ_micro-batches
    d(aux)/dW to the router's gradient (M micro-batches in the step): the difference between
    a run with the loss and one without, against autograd of megatron-core's loss function."""
    base = BASE + LLAMA_GQA + ["--num-experts", "4", "--train-iters", "1", "--lr-warmup-iters"]
    base += ["0", "--global-batch-size", "4"]  # M = 2 micro-batches of 2
    ((weights, inputs, with_aux),) = run_distributed(
        _router_gradients, 1, base + ["--moe-aux-loss-coeff", "0.5"]
    )
    ((_, _, without),) = run_distributed(_router_gradients, 1, base)
    # The last MoE layer's router: no later layer's loss reaches it (an earlier router's
    # gradient also carries the later layers' losses through the activations).
    for w, xs, g_aux, g_plain in list(zip(weights, inputs, with_aux, without))[-1:]:
        w = w.double().requires_grad_(True)
        total = 0.0
        for x in xs:
            scores = torch.softmax(x.double() @ w.t(), -1)
            counts = torch.zeros_like(scores).scatter(1, scores.topk(2, 1).indices, 1.0).sum(0)
            total = total + moe_utils.switch_load_balancing_loss_func(
                scores, counts.detach(), x.shape[0], 2, 4, 0.5
            )
        (total / len(xs)).backward()
        torch.testing.assert_close((g_aux - g_plain).double(), w.grad, rtol=1e-4, atol=1e-7)
