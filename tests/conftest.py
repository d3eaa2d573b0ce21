"""Fixtures shared by the test files: the default model, converted once per session."""

import os

import pytest
from hypothesis import settings

from nanoserve.weights import fetch_default_gguf, fetch_default_model


@pytest.fixture(scope="session")
def smollm_dir():
    """SmolLM2-135M-Instruct converted to a Hugging Face-layout directory under $NANOSERVE_HOME."""
    return fetch_default_model()


@pytest.fixture(scope="session")
def smollm_gguf(smollm_dir):
    """The GGUF the default model was converted from, left in $NANOSERVE_HOME/downloads."""
    return fetch_default_gguf()


@pytest.fixture
def gpt2_gguf(tmp_path):
    """A tiny GGUF of another architecture (gpt2), for the refusals."""
    import gguf
    import numpy as np

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# CI runs the property tests on a fixed sequence of examples, so a submission's verdict does not
# depend on the draw; locally (no CI variable) every run explores new ones.
if os.environ.get("CI"):
    settings.register_profile("ci", derandomize=True, print_blob=True)
    settings.load_profile("ci")
