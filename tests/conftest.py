"""Fixtures shared by the test files: the default model, converted once per session."""

import pytest

from nanoserve.weights import fetch_default_gguf, fetch_default_model


@pytest.fixture(scope="session")
def smollm_dir():
    """SmolLM2-135M-Instruct converted to a Hugging Face-layout directory under $NANOSERVE_HOME."""
    return fetch_default_model()


@pytest.fixture(scope="session")
def smollm_gguf(smollm_dir):
    """The GGUF the default model was converted from, left in $NANOSERVE_HOME/downloads."""
    return fetch_default_gguf()
