import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SPECDEC_ENFORCE_EAGER", "1")  # the torch runner runs eager; tests/test_compiled.py compiles
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("SPECDEC_STRICT_DRAFTER", "1")  # a drafter that raises fails the test (engine.py)
os.environ.setdefault("SPECDEC_AUTO_BACKEND", "torch")  # auto picks the same backend on every machine
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import torch  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED.exists():
        pytest.skip("../shared/data is not present")
    return SHARED


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module's tests: on a 2-core machine with one core busy (a server's
    engine thread, another process), two torch threads make every forward pass far slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> str:
    """The device a test runs on: the CPU always, CUDA where a GPU exists (skipped, saying so, elsewhere)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the cuda variant runs where a GPU exists (benchmarks/gpu_check.sh)")
    return request.param
