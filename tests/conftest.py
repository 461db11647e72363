"""Suite-wide settings: two cores are shared, so every test runs torch on one thread."""
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

try:  # torch is a training dependency; serving tests must run without it
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(scope="module")
def module_home(tmp_path_factory):
    """SLC_HOME in a fresh folder for the whole module: its datasets and bundles stay out of the user's."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("home")
        mp.setenv("SLC_HOME", str(path))
        yield path
