"""The example user project in tests/user_project, run as a user runs it: jaxstep
built into a wheel and installed into a fresh virtual environment, the project copied
outside the source tree, one `pytest` in a subprocess, no conftest.py. What passes
there passes through the plugin's entry point and the installed package alone."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "tests" / "user_project"
BACKENDS = ("shard_map", "pmap")
PASSING = [
    f"test_training.{name}[{b}]"
    for name in (
        "test_training_matches_a_single_device_reference",
        "test_a_nan_gradient_is_pinned_on_its_device_step_and_leaf",
        "test_a_nan_in_the_data_names_the_device_and_input_leaf",
    )
    for b in BACKENDS
] + ["test_training.test_a_misnamed_fault_leaf_is_reported_at_init"]
BROKEN = ["test_broken_model.test_padded_batches_train"]


def _build_wheel(tmp: Path) -> Path:
    """A wheel of jaxstep, built from a copy of the sources (the tree stays clean)."""
    src = tmp / "src"
    shutil.copytree(ROOT / "jaxstep", src / "jaxstep", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp, src],
        check=True,
        timeout=180,
    )
    (wheel,) = tmp.glob("jaxstep-*.whl")
    return wheel


def _fresh_venv(tmp: Path, wheel: Path) -> Path:
    """A venv holding the wheel; its dependencies are borrowed, read-only, from this
    environment, minus every trace of the jaxstep under test (source, editable
    finder, metadata and entry points)."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    site = Path(
        subprocess.check_output(
            [
                venv / "bin" / "python",
                "-c",
                "import sysconfig; print(sysconfig.get_path('purelib'))",
            ],
            text=True,
            timeout=60,
        ).strip()
    )
    deps = tmp / "deps"
    deps.mkdir()
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    for directory in map(Path, ours):
        for entry in directory.iterdir():
            if (
                entry.name.startswith(("jaxstep", "__editable__", "__pycache__"))
                or entry.suffix == ".pth"
            ):
                continue
            if not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    (site / "borrowed_deps.pth").write_text(f"{deps}\n")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", site, wheel],
        check=True,
        timeout=120,
    )
    return venv


def _outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """``{"test_file.test_name[param]": (outcome, failure message)}`` from junit XML."""
    out = {}
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname')}.{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            out[name] = ("failed", f"{failure.get('message')}\n{failure.text}")
        elif case.find("skipped") is not None:
            out[name] = ("skipped", "")
        else:
            out[name] = ("passed", "")
    return out


@pytest.mark.timeout(400)
def test_the_example_project_runs_on_the_installed_package(tmp_path):
    wheel = _build_wheel(tmp_path)
    venv = _fresh_venv(tmp_path, wheel)
    project = tmp_path / "project"
    shutil.copytree(PROJECT, project, ignore=shutil.ignore_patterns("__pycache__"))
    assert not list(project.glob("conftest.py"))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_", "XLA_", "PYTEST_", "PYTHON"))  # the plugin's to set
    }
    report = tmp_path / "report.xml"
    run = subprocess.run(
        [
            venv / "bin" / "python",
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--durations=5",
            f"--junitxml={report}",
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = run.stdout + run.stderr
    # The plugin came through the wheel's entry point, and jaxstep from the wheel.
    header = re.search(r"^jaxstep (\S+) from (\S+): 8 fake CPU devices", log, re.M)
    assert header, log
    assert Path(header.group(2)).resolve().is_relative_to((venv).resolve()), log
    outcomes = _outcomes(report)
    assert sorted(outcomes) == sorted(PASSING + BROKEN), log
    for name in PASSING:
        assert outcomes[name][0] == "passed", f"{name}: {outcomes[name][1]}"
    # The broken model fails through the kit's assertion, which names the device
    # holding the padded rows (the last one), the step and the cause.
    for name in BROKEN:
        outcome, message = outcomes[name]
        assert outcome == "failed", log
        assert "step 0 failed, so the run cannot match the single-device reference" in message
        assert (
            "training worker on device 7 failed: non-finite loss (with non-finite gradient "
            "in ['b1']) at step 0" in message
        ), message
    assert run.returncode == 1, log


def test_the_docs_show_the_example_files_byte_for_byte():
    doc = (ROOT / "docs" / "testing.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", doc, re.S | re.M)
    for name in ("mymodel.py", "test_training.py"):
        assert (PROJECT / name).read_text() in blocks, f"docs/testing.md lacks {name} as is"
