"""A strict CPU stand-in for the `flash_attn` package (FlashAttention-2), for tests, presenting
the API of one real release: 2.5.9.post1, 2.6.3, 2.7.4.post1 or 2.8.3, chosen by the
environment variable MEGATRON_UL_TEST_FLASH_ATTN_VERSION at import (default 2.8.3; the test
fixture `flash_attn_stand_in` runs each). `__version__` is the release's own string.

What differs between the releases, read from flash_attn/flash_attn_interface.py and
csrc/flash_attn/flash_api.cpp at each tag, is in flash_attn_interface.py's docstring (the
private functions' calling conventions: plain functions with `window_size` in 2.5, plus
`softcap` in 2.6, `torch.library.custom_op`s with `window_size_left/right` from 2.7) and in
_kernel.py (the kernels' checks and arithmetic). As the real package, this one exports the
public functions and keeps the private ones in `flash_attn.flash_attn_interface`.

CUDA tensors only, as the kernel: the one exception is megatron_ul's test hook
(megatron_ul.model.attention.flash_attn.FLASH_ON_CPU_ENV set to 1), under which CPU tensors are
accepted so that the flash path runs in CPU tests.
"""

from ._release import API, RELEASES, VERSION
from .flash_attn_interface import calls, flash_attn_func, flash_attn_varlen_func

__version__ = VERSION
IS_STAND_IN = True

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "calls", "API", "RELEASES", "IS_STAND_IN"]
