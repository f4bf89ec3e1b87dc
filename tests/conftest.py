import torch

torch.set_num_threads(2)


import pytest  # noqa: E402


@pytest.fixture
def device_path(monkeypatch):
    """The factorization as on a GPU (every jitter try batched, no host read): for tests
    that count host reads or kernels on this CPU as stand-ins for a device's."""
    from tengrad_fx.solve import woodbury

    monkeypatch.setattr(woodbury, "HOST_RETRIES", False)
