"""The ``device`` fixture: each numerics test body is written once and runs on every device present."""

import pytest
import torch

from sdkiln.kernels import current_platform

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")],
    ),
    pytest.param(
        "npu",
        id="npu",
        marks=[pytest.mark.npu, pytest.mark.skipif(not current_platform().is_npu, reason="no Ascend NPU")],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)
