"""Suite-wide settings: two cores are shared, so every test runs torch on one thread."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

try:  # torch is a training dependency; serving tests must run without it
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass
