"""Shared pytest configuration: slow tests are opt-in (pytest.ini puts the repository root on
the import path, so tests import megatron_ul, tools and tests without installing anything)."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run tests marked slow (long layout matrices, benchmarks-as-checks)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running; runs only with --run-slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


STAND_INS = os.path.join(ROOT, "tests", "stand_ins")


# The releases of flash-attn whose API the stand-in presents (tests/stand_ins/flash_attn).
FLASH_ATTN_RELEASES = ("2.5.9.post1", "2.6.3", "2.7.4.post1", "2.8.3")
FLASH_ATTN_VERSION_ENV = "MEGATRON_UL_TEST_FLASH_ATTN_VERSION"


@pytest.fixture(params=FLASH_ATTN_RELEASES, ids=[f"fa{r[:3]}" for r in FLASH_ATTN_RELEASES])
def flash_attn_stand_in(request, monkeypatch):
    """The strict CPU stand-in of `flash_attn` (tests/stand_ins/flash_attn) importable as
    `flash_attn`, presenting each release's API in turn (a test picks some with
    parametrize(..., indirect=True)), plus megatron_ul's documented test hook that lets the flash
    path run on CPU (megatron_ul.model.attention.flash_attn.FLASH_ON_CPU_ENV). Ranks started by
    run_on_local_ranks inherit both (it passes sys.path and the environment). Yields the
    stand-in module."""
    from megatron_ul.model.attention.flash_attn import FLASH_ON_CPU_ENV

    monkeypatch.syspath_prepend(STAND_INS)
    monkeypatch.setenv(FLASH_ON_CPU_ENV, "1")
    monkeypatch.setenv(FLASH_ATTN_VERSION_ENV, request.param)
    _forget_flash_attn()
    import flash_attn
    import flash_attn.flash_attn_interface

    assert getattr(flash_attn, "IS_STAND_IN", False), flash_attn.__file__
    assert flash_attn.__version__ == request.param
    for name in flash_attn.calls:
        flash_attn.calls[name] = 0
    yield flash_attn
    _forget_flash_attn()


def _forget_flash_attn():
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        sys.modules.pop(name)
