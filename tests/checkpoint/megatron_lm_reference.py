"""Megatron-LM's own legacy GPT on CPU, as the reference for the legacy-checkpoint tests.

Run with PYTHONPATH=$MEGATRON_LM_DIR (a checkout that still has megatron/legacy, e.g. the
commit before its removal) by tests/checkpoint/test_megatron_lm_reference.py:

    python megatron_lm_reference.py logits OUT.pt TOKENS.pt -- MEGATRON FLAGS... --load DIR
    python megatron_lm_reference.py save OUT_DIR -- MEGATRON FLAGS...

`logits` parses the flags with Megatron's own parse_args/validate_args, builds the model the
way its gpt_builder does, loads DIR with its load_checkpoint (check_checkpoint_args included)
and writes the logits of TOKENS; `save` builds a seeded model and writes it with Megatron's
save_checkpoint (args, enums, numpy RNG state: the real file). One process, gloo, TP1 PP1.
"""

import os
import sys

import torch


def _apex_layer_norm_stand_in() -> None:
    """Megatron's legacy LayerNorm needs apex's fused kernel; apex's fused_layer_norm_affine
    computes F.layer_norm(x, shape, weight, bias, eps), which is what stands in for it."""
    import types

    fused = types.ModuleType("apex.normalization.fused_layer_norm")
    fused.fused_layer_norm_affine = lambda x, weight, bias, shape, eps: (
        torch.nn.functional.layer_norm(x, shape, weight, bias, eps)
    )
    for name, module in [
        ("apex", types.ModuleType("apex")),
        ("apex.normalization", types.ModuleType("apex.normalization")),
        ("apex.normalization.fused_layer_norm", fused),
        ("fused_layer_norm_cuda", types.ModuleType("fused_layer_norm_cuda")),
    ]:
        sys.modules.setdefault(name, module)


def _init(flags: list) -> object:
    # Megatron's legacy RotaryEmbedding ignores --use-cpu-initialization and places its
    # frequencies on torch.cuda.current_device(); on CPU that device is the CPU.
    torch.cuda.current_device = lambda: "cpu"
    # ... and its checkpoint loader all-reduces the iteration in a tensor made on 'cuda'
    make_tensor = torch.tensor
    torch.tensor = lambda *a, device=None, **k: make_tensor(
        *a, device="cpu" if str(device).startswith("cuda") else device, **k
    )
    _apex_layer_norm_stand_in()
    # CPU: no fused CUDA kernels (the same math unfused), no dropout
    sys.argv = (
        ["megatron_lm_reference"]
        + flags
        + [
            "--micro-batch-size",
            "1",
            "--use-cpu-initialization",
            "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion",
            "--no-bias-dropout-fusion",
            "--no-persist-layer-norm",
            "--no-rope-fusion",
            "--attention-dropout",
            "0",
            "--hidden-dropout",
            "0",
            "--seed",
            "5",
        ]
    )
    import tempfile

    store = os.path.join(tempfile.mkdtemp(), "store")  # no port to race for
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    from megatron.core import parallel_state
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    args = parse_args()
    validate_args(args)
    from megatron.core.enums import ModelType

    args.model_type = ModelType.encoder_or_decoder  # as pretrain() sets it for GPT
    args.apply_layernorm_1p = False  # read by the legacy norms, gone from the parser
    set_global_variables(args)
    parallel_state.initialize_model_parallel(1, 1)
    # the attention forks the CUDA dropout generator; dropout is 0, so no generator is needed
    import contextlib

    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return args


def _model(args):
    torch.manual_seed(args.seed)
    from gpt_builders import gpt_builder

    model = gpt_builder(args, pre_process=True, post_process=True)
    return model.float().eval()


def logits(out: str, tokens_file: str, flags: list) -> None:
    args = _init(flags)
    model = _model(args)
    from megatron.training.checkpointing import load_checkpoint

    load_checkpoint([model], None, None, strict=True)
    tokens = torch.load(tokens_file)
    b, s = tokens.shape
    mask = torch.tril(torch.ones(1, 1, s, s)) < 0.5
    with torch.no_grad():
        result = model(tokens, torch.arange(s).expand(b, s), mask)
    torch.save({"logits": result.float(), "padded_vocab_size": args.padded_vocab_size}, out)


def save(out_dir: str, flags: list) -> None:
    args = _init(flags + ["--save", out_dir, "--save-interval", "1"])
    model = _model(args)
    with torch.no_grad():  # non-trivial norms and biases
        g = torch.Generator().manual_seed(11)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    # Megatron records the CUDA generator too; on CPU stand in the CPU one (same type).
    torch.cuda.get_rng_state = torch.get_rng_state
    from megatron.training.checkpointing import save_checkpoint

    save_checkpoint(3, [model], None, None, 0)
    torch.save(
        {
            n: p.detach().clone()
            for n, p in model.state_dict().items()
            if isinstance(p, torch.Tensor)
        },
        os.path.join(out_dir, "reference_weights.pt"),
    )


if __name__ == "__main__":
    split = sys.argv.index("--")
    command, positional, megatron_flags = sys.argv[1], sys.argv[2:split], sys.argv[split + 1 :]
    {"logits": logits, "save": save}[command](*positional, megatron_flags)
