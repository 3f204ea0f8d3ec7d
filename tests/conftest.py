import pytest
import torch


@pytest.fixture(scope="session")
def digits_snapshots():
    """(model, optimizer, snapshots, eval_fn) of a real 10-checkpoint Adam run on digits."""
    from ckptzip.demo.workloads import digits_run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster, and far faster on a loaded machine
    try:
        return digits_run(n_checkpoints=10, steps_between=20)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _restore_torch_state():
    # tests must leave global state as they found it
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    yield
    torch.set_rng_state(rng)
    torch.set_num_threads(threads)
