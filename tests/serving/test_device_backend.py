"""The device backend (serving/core/device/) on a CPU machine: the providers and options each device
setting gets, the policies asked of it (lanes, the one-thread session, the device pass, the class
index), the libcuda probe without a driver, and the registry of HeadPass strategies."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from serving.core.device import backend, index, libcuda

GPU = "CUDAExecutionProvider"


def _runtime(providers, threads=2):
    return SimpleNamespace(providers=list(providers), threads=threads)


def test_the_provider_lists_keep_tf32_off_and_cudnn_by_heuristics():
    """The options measured on the H200, exactly: the backbone's CUDA with TF32 off and cuDNN's
    heuristic search; the device head's on its device id with TF32 off; the CPU after both."""
    assert backend.CUDA == [(GPU, {"use_tf32": "0", "cudnn_conv_algo_search": "HEURISTIC"}), "CPUExecutionProvider"]
    assert backend.head_providers("cuda", 1) == [(GPU, {"device_id": "1", "use_tf32": "0"}), "CPUExecutionProvider"]
    assert backend.head_providers("cpu") == ["CPUExecutionProvider"] == backend.providers("cpu")


def test_cuda_asked_of_an_onnxruntime_without_it_is_one_error(monkeypatch):
    monkeypatch.setattr(backend.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(RuntimeError, match="no CUDAExecutionProvider"):
        backend.providers("cuda")
    assert backend.providers("auto") == backend.CPU


def test_auto_tries_cuda_only_where_the_driver_sees_a_gpu(monkeypatch):
    monkeypatch.setattr(backend.ort, "get_available_providers", lambda: [GPU, "CPUExecutionProvider"])
    monkeypatch.setattr(backend, "preload_cuda", lambda: None)
    monkeypatch.setattr(backend, "cuda_device_count", lambda: 0)
    assert backend.providers("auto") == backend.CPU
    monkeypatch.setattr(backend, "cuda_device_count", lambda: 1)
    assert backend.providers("auto") == backend.CUDA


def test_a_session_that_fell_back_to_the_cpu_is_refused_only_when_cuda_was_named():
    backend.require("auto", ["CPUExecutionProvider"], "x")
    backend.require("cuda", [GPU, "CPUExecutionProvider"], "x")
    with pytest.raises(RuntimeError, match="could not use CUDA"):
        backend.require("cuda", ["CPUExecutionProvider"], "the backbone session")


def test_the_policies_asked_of_the_backend():
    cpu, gpu = _runtime(["CPUExecutionProvider"]), _runtime([GPU, "CPUExecutionProvider"])
    assert (backend.kind(cpu), backend.kind(gpu)) == ("cpu", "cuda")
    assert backend.lanes(2, cpu) == 2 and backend.lanes(2, gpu) == 1 and backend.lanes(2, _runtime(cpu.providers, 1)) == 1
    assert backend.small_session_pays(2, cpu.providers) and backend.small_session_pays(1, gpu.providers)
    assert not backend.small_session_pays(1, cpu.providers)
    assert backend.head_pass_on_device("auto", gpu) and not backend.head_pass_on_device("auto", cpu)
    assert backend.head_pass_on_device("device", cpu) and not backend.head_pass_on_device("ort", gpu)


def test_the_class_index_policy():
    assert index.index_kind("auto", "auto", "cuda") == "exact" == index.index_kind("auto", "device", "cuda")
    assert index.index_kind("auto", "ort", "cuda") is None and index.index_kind("auto", "auto", "cpu") is None
    assert index.index_kind("ivf", "auto", "cuda") == "ivf"


def test_with_faiss_cpu_an_index_asked_for_on_cuda_stays_on_the_cpu(caplog):
    import faiss

    if index.faiss_gpus():
        pytest.skip("a faiss GPU build")
    flat = faiss.IndexFlatIP(4)
    assert index.place_index(flat, "cuda") == (flat, "cpu")
    assert "faiss GPU not installed" in caplog.text
    assert index.place_index(flat, "cpu") == (flat, "cpu")
    with pytest.raises(ValueError):
        index.place_index(flat, "tpu")


def test_the_libcuda_probe_without_a_driver(monkeypatch):
    def no_driver(name):
        raise OSError(name)

    monkeypatch.setattr(libcuda.ctypes, "CDLL", no_driver)
    assert libcuda.cuda_device_count() == 0 and libcuda.cuda_memory(0) is None


# ------------------------------------------------------------------------------ HeadPass strategies
def test_every_strategy_is_registered_once_under_its_name():
    from serving.core import compute  # noqa: F401 - registers the device's strategy too
    from serving.core.head_strategies import STRATEGIES

    assert set(STRATEGIES) == {"numpy", "ort", "ort_pair", "packed_pair", "onnx", "int8", "bf16", "device"}
    assert all(cls.name == name for name, cls in STRATEGIES.items())
    assert set(compute.PREFERENCE) == set(STRATEGIES)


def test_each_strategy_owns_its_state_and_answers_as_the_others(client_factory, inputs):
    """Under ort_pair, numpy and ort each hold their own chunk buffer; every strategy's softmax of the
    same rows is the same; after warm-up only the chosen strategy is kept."""
    from serving.core import head_scan

    head_pass = client_factory(intra_op_threads=2).app.state.slc.engine.head_pass
    assert list(head_pass._impls) == [head_pass.name]
    h = head_pass.runtime.embed(np.asarray(inputs, np.float32))
    answers = {}
    for name in ("numpy", "ort", "ort_pair", "packed_pair", "device"):
        parts = [(slice(i, i + 1), head_scan.SoftmaxStats(1, 3)) for i in range(len(h))]
        head_pass._strategy(name)(None, h, parts)
        answers[name] = np.array([acc.result()[0] for _, acc in parts], np.float64).ravel()
    for name, got in answers.items():
        np.testing.assert_allclose(got, answers["numpy"], rtol=1e-5, atol=1e-6, err_msg=name)
    assert head_pass._impls["numpy"].buf is not head_pass._impls["ort"].buf
    assert head_pass._impls["ort_pair"].buffers is not head_pass._impls["packed_pair"].buffers
