import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch, so counts of graphs and compiles are the test's own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
