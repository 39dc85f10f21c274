"""The MoE router: a replicated [experts, hidden] gate, top-k selection, capacity dropping and
the load-balancing and z losses, with megatron-core's semantics (megatron/core/transformer/moe/
router.py TopKRouter.routing and moe_utils.py: topk_routing_with_score_function,
apply_router_token_dropping, switch_load_balancing_loss_func, z_loss_func, get_capacity,
MoEAuxLossAutoScaler). tests/moe/test_router.py checks each against megatron-core's function.

Tokens are rows: logits [T, E] for this rank's T tokens. The auxiliary losses are not added to
the language-model loss; they ride on the router's output through `AuxLossScaler`, whose
backward injects d(aux)/d(aux) = `scale` (Megatron's trick: the loss of a pipeline stage that
is not the last one still reaches backward). `scale` is 1/(micro-batches per step × DP) times
the fp16 loss scale, set by the training step (`set_aux_loss_scale`), which makes each aux loss
count as its mean over the global batch's micro-batches, as in Megatron.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ...mpu.mappings import all_reduce, group_size
from ...mpu.param_init import Init, new_parameter
from ...mpu.param_spec import set_param_spec

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DROP_POLICIES = ("probs", "position")


def topk_routing(
    logits: torch.Tensor, topk: int, pre_softmax: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E], zero off the chosen experts; routing map [T, E] bool).

    Softmax then top-k under --moe-router-pre-softmax, else top-k of the logits and a softmax
    over the k chosen (Mixtral's order); the softmax runs in fp32."""
    if pre_softmax:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        top, index = torch.topk(scores, topk, dim=1)
    else:
        top_logits, index = torch.topk(logits, topk, dim=1)
        top = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
    probs = torch.zeros_like(logits).scatter(1, index, top)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)
    return probs, routing_map


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens an expert takes: ceil(T·k / E · factor), T·k being the routed (token, expert)
    pairs (megatron-core's get_capacity on num_tokens · topk)."""
    return math.ceil(num_tokens / num_experts * capacity_factor)


def drop_over_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    capacity_factor: float,
    policy: str = "probs",
    pad_to_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most `capacity` tokens per expert: those of highest probability ("probs") or
    the first in token order ("position"). With pad_to_capacity every expert gets exactly
    `capacity` rows (unchosen ones with probability 0), so shapes are static."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens * topk, num_experts, capacity_factor)
    if capacity > num_tokens:
        keep = torch.ones_like(routing_map)
    elif policy == "probs":
        _, rows = torch.topk(probs, capacity, dim=0, sorted=False)
        keep = torch.zeros_like(routing_map).scatter(0, rows, True)
    elif policy == "position":
        # The first `capacity` chosen tokens of each expert, then (only when padding) the
        # first unchosen ones: a stable order, as megatron-core's top-k over the 0/1 map.
        chosen = routing_map.int()
        rank_chosen = chosen.cumsum(0)
        rank_other = (1 - chosen).cumsum(0) + chosen.sum(0, keepdim=True)
        order = torch.where(routing_map, rank_chosen, rank_other)
        keep = order <= capacity
    else:
        raise ValueError(f"--moe-token-drop-policy {policy!r} is not one of {DROP_POLICIES}")
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map


def load_balancing_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_tokens: int,
    topk: int,
    num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """Switch Transformer's loss E · Σ_i f_i · P_i, with f_i the fraction of the batch's routed
    pairs sent to expert i (`tokens_per_expert` counts the whole batch, over every rank that
    holds part of it) and P_i this rank's share of the mean router probability: summed over
    those ranks it is the batch's loss."""
    per_expert = scores.sum(dim=0) * tokens_per_expert
    return per_expert.sum() * (num_experts * coeff / (topk * total_tokens * total_tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z loss: coeff · mean over tokens of logsumexp(logits)²."""
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


class AuxLossScaler(torch.autograd.Function):
    """Identity on `output`; backward also gives `aux_loss` the gradient `scale` (a float)."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


class TopKRouter(nn.Module):
    """router.weight [E, h], replicated; logits in at least fp32 (megatron-core's
    --moe-router-dtype fp32). Returns (probs [T, E], routing map [T, E]) for x [T, h].

    `token_group` holds the ranks that split one micro-batch's tokens (CP × SP, and TP under
    Megatron-SP): the aux loss's expert counts are summed over it and the z loss's coefficient
    divided by its size, so the parts on those ranks add up to the micro-batch's losses.
    `seq_length` is the local tokens per sequence (for seq_aux_loss: x is [s, b] flattened)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        topk: int,
        init: Init,
        *,
        pre_softmax: bool = False,
        load_balancing: str = "aux_loss",
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float | None = None,
        capacity_factor: float | None = None,
        drop_policy: str = "probs",
        pad_to_capacity: bool = False,
        sequence_parallel: bool = False,
        token_group=None,
        device=None,
        dtype=torch.float32,
    ):
        super().__init__()
        self.num_experts, self.topk, self.pre_softmax = num_experts, topk, pre_softmax
        self.load_balancing, self.aux_loss_coeff = load_balancing, aux_loss_coeff
        self.z_loss_coeff = z_loss_coeff
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.pad_to_capacity = pad_to_capacity
        self.token_group = token_group
        self.weight = new_parameter(init, (num_experts, hidden_size), device=device, dtype=dtype)
        # Under Megatron-SP each TP rank routes its own tokens: the gradient sums over TP.
        set_param_spec(self.weight, sequence_parallel=sequence_parallel)
        self.aux_loss_scale = 1.0  # set by the training step (module docstring)
        # Per-micro-batch losses (divided by their coefficient), summed on the device until
        # `take_aux_losses` reads them: no host sync on the micro-batch path.
        self.logged: dict[str, torch.Tensor] = {}
        self.logged_micro_batches = 0

    def forward(self, x: torch.Tensor, seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = torch.promote_types(x.dtype, torch.float32)  # at least fp32
        logits = torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype))
        training = self.training and torch.is_grad_enabled()
        if training:
            self.logged_micro_batches += 1
        if training and self.z_loss_coeff:
            coeff = self.z_loss_coeff / group_size(self.token_group)
            loss = z_loss(logits, coeff)
            logits = AuxLossScaler.apply(logits, loss, self.aux_loss_scale)
            # logged as this rank's share of the micro-batch's mean (the shares add up)
            self._log("z_loss", loss.detach() / self.z_loss_coeff)
        probs, routing_map = topk_routing(logits, self.topk, self.pre_softmax)
        if self.capacity_factor is not None:
            probs, routing_map = drop_over_capacity(
                probs,
                routing_map,
                self.topk,
                self.capacity_factor,
                self.drop_policy,
                self.pad_to_capacity,
            )
        if training and self.load_balancing != "none" and self.aux_loss_coeff > 0:
            probs = self._attach_load_balancing(probs, logits, seq_length)
        return probs, routing_map

    def _attach_load_balancing(self, probs, logits, seq_length: int) -> torch.Tensor:
        # The loss sees the routing before capacity dropping (megatron-core's
        # compute_routing_scores_for_aux_loss).
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        _, index = torch.topk(scores, self.topk, dim=1)
        chosen = torch.zeros_like(scores).scatter(1, index, 1.0)
        parts = group_size(self.token_group)
        if self.load_balancing == "seq_aux_loss":
            # Each sequence's experts as separate columns: the loss is their sum, then mean.
            batch = scores.shape[0] // seq_length
            counts = all_reduce(chosen.reshape(seq_length, -1).sum(0), self.token_group)
            loss = (
                load_balancing_loss(
                    scores.reshape(seq_length, -1),
                    counts,
                    seq_length * parts,
                    self.topk,
                    self.num_experts,
                    self.aux_loss_coeff,
                )
                / batch
            )
            name = "seq_load_balancing_loss"
        else:
            counts = all_reduce(chosen.sum(0), self.token_group)
            loss = load_balancing_loss(
                scores,
                counts,
                scores.shape[0] * parts,
                self.topk,
                self.num_experts,
                self.aux_loss_coeff,
            )
            name = "load_balancing_loss"
        self._log(name, loss.detach() / self.aux_loss_coeff)
        return AuxLossScaler.apply(probs, loss, self.aux_loss_scale)

    def _log(self, name: str, value: torch.Tensor) -> None:
        held = self.logged.get(name)
        self.logged[name] = value if held is None else held + value


def aux_loss_names(load_balancing: str, aux_loss_coeff: float, z_loss_coeff) -> list[str]:
    """The losses a router with these settings logs (Megatron's tracker names)."""
    names = []
    if load_balancing != "none" and aux_loss_coeff > 0:
        names.append(
            "seq_load_balancing_loss" if load_balancing == "seq_aux_loss" else "load_balancing_loss"
        )
    if z_loss_coeff:
        names.append("z_loss")
    return names


def take_aux_losses(
    routers: dict[int, TopKRouter], layers: list[int], names: list[str], dims, device
) -> dict[str, float]:
    """{"moe/<loss>_layer_<n>": value, "moe/<loss>": mean over layers} for every MoE layer of
    the model (`layers`, global numbers, whichever stage holds them), each averaged over the
    micro-batches since the last call and over DP, and each the whole micro-batch's loss (its
    parts summed over the ranks that split the micro-batch); resets the routers' records.
    Collective over dp_cp_sp, TP and PP (every rank calls it); one host sync."""
    if not layers or not names:
        return {}
    values = torch.zeros(len(layers), len(names), dtype=torch.float32, device=device)
    for i, n in enumerate(layers):
        router = routers.get(n)
        if router is None:  # on another pipeline stage
            continue
        for j, name in enumerate(names):
            if name in router.logged:
                values[i, j] = router.logged[name].float() / max(router.logged_micro_batches, 1)
        router.logged, router.logged_micro_batches = {}, 0
    # The parts of one micro-batch are on dp_cp_sp's CP × SP ranks (and TP's under
    # Megatron-SP, whose tokens differ; without it TP ranks hold copies): sum, then mean
    # over DP. Each layer lives on one pipeline stage: summing over PP collects them.
    token_group = next(iter(routers.values())).token_group if routers else None
    tp_parts = group_size(token_group) // (dims.sp * dims.cp) if routers else 1
    if dims.dp_cp_sp_size > 1:
        dist.all_reduce(values, group=dims.dp_cp_sp_group)
    if tp_parts > 1:
        dist.all_reduce(values, group=dims.tp_group)
    if dims.pp > 1:
        dist.all_reduce(values, group=dims.pp_group)
    values = (values / dims.dp).tolist()
    report = {}
    for j, name in enumerate(names):
        for i, n in enumerate(layers):
            report[f"moe/{name}_layer_{n}"] = values[i][j]
        report[f"moe/{name}"] = sum(row[j] for row in values) / len(layers)
    return report
