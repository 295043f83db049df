"""Shared fixtures. MiniLM is loaded once per session (it takes a few seconds)."""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def minilm():
    import workbench as wb

    return wb.models.load("minilm")


@pytest.fixture(scope="session")
def minilm_task():
    import workbench as wb

    return wb.tasks.load("minilm")


@pytest.fixture
def digits_mlp():
    import workbench as wb

    return wb.models.load("digits-mlp")


@pytest.fixture(scope="session")
def digits_task():
    import workbench as wb

    return wb.tasks.load("digits")
