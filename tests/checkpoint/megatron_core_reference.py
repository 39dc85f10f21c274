"""Megatron-LM's own save_checkpoint of a megatron-core GPTModel on CPU, as the reference for
tests/checkpoint/test_megatron_core_reference.py:

    PYTHONPATH=MEGATRON_LM_DIR python megatron_core_reference.py MEGATRON_LM_DIR OUT_DIR FORMAT
    PYTHONPATH=MEGATRON_LM_DIR python megatron_core_reference.py MEGATRON_LM_DIR LOAD_DIR \
        LOGITS.pt -- PRINTED FLAGS...

parses a Llama-style model's flags (RoPE, SwiGLU, RMSNorm, untied, no biases, --window-size
4,0, NullTokenizer --vocab-size 200) with the checkout's own parse_args/validate_args, builds
the model with its gpt_builder (local spec), perturbs every parameter, writes it with its
save_checkpoint (args with that release's enums, RNG state: the real file), and saves the
model's logits of fixed tokens and its tokenizer's vocabulary size to
OUT_DIR/reference_logits.pt. The second form builds the model from an export's printed flags,
loads the export with the checkout's load_checkpoint (strict) and writes those logits. One
process, gloo, TP1 PP1.

CPU stand-ins, none of which changes a number: the checkout's triton-importing modules and
Python 3.12's typing.override (tests/data/megatron_lm_preprocess_launcher.py);
torch.cuda.current_device is the CPU, torch.cuda.synchronize does nothing,
torch.cuda.get_rng_state is the CPU generator's, tensors asked for on 'cuda' (its iteration
all-reduce, its sliding-window mask) are made on the CPU, and the attention's CUDA RNG fork is
a no-op (dropout is 0).
"""

import contextlib
import importlib.util
import os
import sys
import tempfile

FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
    "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
    "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
    "--window-size", "4,0", "--make-vocab-size-divisible-by", "16",
    "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
    "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
    "--no-bias-swiglu-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--seed", "5", "--train-iters", "1", "--lr", "1e-4", "--save-interval", "1",
]  # fmt: skip


def _cuda_on_cpu(torch) -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = torch.get_rng_state
    for name in ("tensor", "ones"):
        make = getattr(torch, name)

        def on_cpu(*a, device=None, _make=make, **k):
            return _make(*a, device="cpu" if str(device).startswith("cuda") else device, **k)

        setattr(torch, name, on_cpu)


def main(root: str, out_dir: str, fmt: str, load_flags: list | None = None) -> None:
    """Save a perturbed model to `out_dir` in format `fmt`; or, with `load_flags` (the flags an
    export of ours printed), build the model from those flags, load `out_dir` with Megatron's
    load_checkpoint (strict, its check_checkpoint_args included) and write its logits to
    `fmt` (a file path)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "data", "megatron_lm_preprocess_launcher.py")
    spec = importlib.util.spec_from_file_location("launcher", path)
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    import typing

    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    sys.meta_path.insert(0, launcher._StubFinder(launcher._triton_modules(root)))
    import torch

    _cuda_on_cpu(torch)
    store = os.path.join(tempfile.mkdtemp(), "store")
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    if load_flags is None:
        sys.argv = ["pretrain_gpt", *FLAGS, "--save", out_dir, "--ckpt-format", fmt]
    else:  # the printed flags, then what a CPU run adds
        cpu = FLAGS[FLAGS.index("--micro-batch-size") : FLAGS.index("--micro-batch-size") + 2]
        cpu += FLAGS[FLAGS.index("--use-cpu-initialization") :]
        sys.argv = ["pretrain_gpt", *load_flags, *cpu, "--load", out_dir]
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    args = parse_args()
    validate_args(args)
    from megatron.core.enums import ModelType

    args.model_type = ModelType.encoder_or_decoder  # as pretrain() sets it for GPT
    set_global_variables(args)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(5)
    from gpt_builders import gpt_builder
    from megatron.training.checkpointing import save_checkpoint

    model = gpt_builder(args, True, True).float()
    if load_flags is None:
        with torch.no_grad():
            g = torch.Generator().manual_seed(11)
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        save_checkpoint(3, [model], None, None, 0)
    else:
        from megatron.training.checkpointing import load_checkpoint

        load_checkpoint([model], None, None, strict=True)
    model.eval()
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(3))
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        logits = model(tokens, torch.arange(16).expand(2, 16), causal)
    from megatron.training.global_vars import get_tokenizer

    torch.save(
        {"tokens": tokens, "logits": logits.float(), "vocab": get_tokenizer().vocab_size},
        fmt if load_flags is not None else os.path.join(out_dir, "reference_logits.pt"),
    )


if __name__ == "__main__":  # the guard matters: its torch_dist writer starts a Manager process
    # save: ROOT OUT_DIR FORMAT; load: ROOT LOAD_DIR LOGITS_FILE -- PRINTED FLAGS...
    rest = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else None
    main(*sys.argv[1:4], load_flags=rest)
