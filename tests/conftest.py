import zlib

import numpy as np
import pytest

import cukernels as ck


def pytest_collection_modifyitems(config, items):
    if ck.gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device visible to CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    # A fresh seed per test (stable across runs of the same test, distinct between tests).
    seed = zlib.crc32(request.node.nodeid.encode())  # (str hash() is salted per process: not stable)
    return np.random.default_rng(seed)
