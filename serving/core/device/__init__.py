"""The execution device as one backend (issue 49): every CUDA decision of the server is made here and
nowhere else (tests/test_layout.py checks it). backend.py: providers, sessions with the CPU fallback,
lanes and which passes may go on the device; libcuda.py: the one probe of the CUDA driver; memory.py:
whether a head fits; head.py / head_pass.py: the head resident on the device and its pass; index.py:
the class index's kind and placement."""
