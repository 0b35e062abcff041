"""The example notebooks run top to bottom and produce their plots."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))
MINI = ROOT / "checkpoints" / "fnx-mini"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    assert MINI.is_dir(), f"the shipped checkpoint {MINI} is missing"
    nb = nbformat.read(path, as_version=4)
    env_before = os.environ.get("FNX_MODEL")
    os.environ["FNX_MODEL"] = str(MINI)
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "examples")}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("FNX_MODEL", None)
        else:
            os.environ["FNX_MODEL"] = env_before
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    n_plots = sum("image/png" in o.get("data", {}) for o in outputs)
    expected = {"01_quickstart.ipynb": 0}.get(path.name, 1)
    assert n_plots >= expected, f"{path.name} produced {n_plots} plots"
