"""The documentation site builds in the suite, once, as ``make docs`` builds it: every
warning an error, every public name with an entry in the API reference
(docs/ext/coverage_check.py), and the notebooks executed in the build on 8 fake CPU
devices, an error in a cell failing it. The notebooks run here and nowhere else: this
test reads what they printed from the build's executed copies."""

import os
import pathlib
import subprocess
import sys

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
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


def test_every_notebook_says_what_it_prints():
    assert sorted(PRINTED) == [p.name for p in NOTEBOOKS]


@pytest.mark.timeout(900)
def test_the_site_builds_with_warnings_as_errors_and_runs_every_notebook(tmp_path):
    html = tmp_path / "html"
    env = dict(os.environ, JAXSTEP_DOCS_EXECUTE="force")  # never a cached notebook here
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "docs", html],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    log = build.stdout + build.stderr
    assert build.returncode == 0, f"make docs failed (exit {build.returncode}):\n{log[-12000:]}"
    assert "public names have an entry in the reference" in log  # the coverage check ran
    assert "jaxstep.make_train_step" in (html / "api" / "step.html").read_text()
    # myst-nb writes the executed notebooks beside the output folder.
    for path in NOTEBOOKS:
        nb = nbformat.read(tmp_path / "jupyter_execute" / "notebooks" / path.name, as_version=4)
        outputs = [o for c in nb.cells for o in c.get("outputs", [])]
        assert not [o for o in outputs if o.output_type == "error"], path.name
        printed = "".join(o.get("text", "") for o in outputs)
        missing = [words for words in PRINTED[path.name] if words not in printed]
        assert not missing, f"{path.name} did not print {missing}:\n{printed[-4000:]}"
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name}: no picture"
    # docs/goodput.md runs the demo with a fault and --recover: its table and its plot
    page = nbformat.read(tmp_path / "jupyter_execute" / "goodput.ipynb", as_version=4)
    outputs = [o for c in page.cells for o in c.get("outputs", [])]
    printed = "".join(o.get("text", "") for o in outputs)
    assert "jaxstep goodput:" in printed and "(1 failed)" in printed, printed[-4000:]
    assert any("image/png" in o.get("data", {}) for o in outputs)
