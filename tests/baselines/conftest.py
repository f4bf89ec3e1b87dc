import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """These tests run tiny float64 ops, where a second intra-op thread only adds
    synchronization (and stalls badly on a loaded machine); restored afterwards."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
