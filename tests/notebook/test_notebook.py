"""The notebooks run top to bottom on fake CPU devices, and are committed without
outputs (so a diff shows code, and a stale output never misleads)."""

import os
import pathlib

import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
#: what each notebook prints when it works (a new notebook adds its line here)
PRINTED = {
    "quickstart.ipynb": [
        "training worker on device 3 failed: non-finite input in ['image']",
        "test accuracy",
    ],
    "recovery.ipynb": [
        "recovered at step 3: transient -> retried (device 2)",
        "recovered at step 5: data -> quarantined (device 3); examples [43]",
        "quarantine file: Quarantine({5: (43,)})",
        "epoch 1: filtered ids [], recoveries 1",
        "epoch 2: filtered ids [600], recoveries 0",
        "recovered at step 4: device -> excluded (device 5)",
        "devices now: [0, 1, 2, 3, 4, 6, 7]",
        "recovered at step 10: spike -> rolled back",
        "recovered at step 5: diverged -> repaired (device 6)",
        "not recovered: the budget of max_recoveries=1 recoveries is spent",
    ],
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, path
    assert all(not c.outputs and c.execution_count is None for c in code), (
        f"{path.name} has outputs: clear them before committing (make strip-notebooks)"
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_on_fake_devices(path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    # A fresh kernel process: its own 8 fake CPU devices, this checkout's jaxstep.
    env = {"JAX_PLATFORMS": "cpu", "MPLBACKEND": "Agg"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=180, kernel_name="python3", resources={
            "metadata": {"path": str(path.parents[1])}
        }).execute()  # fmt: skip
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    for words in PRINTED[path.name]:
        assert words in printed
