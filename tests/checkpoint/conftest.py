import numpy as np
import pytest

from tests.conftest import load_script


@pytest.fixture(scope="session")
def tiny_script():
    return load_script("make_tiny_checkpoint")


@pytest.fixture(scope="session")
def src(tiny_script, tmp_path_factory):
    """tiny-a in float32, with its 31 mtp.* tensors."""
    return tiny_script.write_checkpoint(tmp_path_factory.mktemp("src") / "tiny-a", "tiny-a", seed=3)


@pytest.fixture(scope="session")
def ids():
    return np.random.default_rng(0).integers(0, 256, size=(2, 24))



@pytest.fixture(scope="session")
def fp8_dirs(src, tmp_path_factory):
    """(FP8 block release layout, float checkpoint of its dequantized weights), from `src`."""
    from tests.checkpoint import writers
    return writers.write_fp8(src, tmp_path_factory.mktemp("fp8"))
