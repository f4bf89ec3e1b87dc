"""Curvature tests run tiny tensors: one intra-op thread is faster (much faster on a
loaded machine, where two spinning threads per process contend)."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
