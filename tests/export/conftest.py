"""Fixtures the export tests share."""
import shutil

import pytest

import workbench as wb


@pytest.fixture(scope="module")
def tiny_llama():
    """The zoo's tiny-llama (fp32, its own byte-level BPE tokenizer); module scope: tests must not modify it."""
    return wb.models.load("tiny-llama")


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """A folder holding only tiny-llama's tokenizer.json (a byte-level BPE of 4,096 tokens)."""
    from workbench.models.llama import TOKENIZER_FILE
    from workbench.paths import data_dir

    folder = tmp_path_factory.mktemp("tokenizer")
    shutil.copy(data_dir() / TOKENIZER_FILE, folder / "tokenizer.json")
    return folder
