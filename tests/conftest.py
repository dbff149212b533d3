import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """The test models are tiny: they run fastest on one thread, and many times
    slower when two threads contend for the 2 cores of a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
