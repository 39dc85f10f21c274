"""Shared pytest configuration: slow tests are opt-in (pytest.ini puts the repository root on
the import path, so tests import megatron_ul, tools and tests without installing anything)."""
import pytest


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked slow (long layout matrices, benchmarks-as-checks)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running; runs only with --run-slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
