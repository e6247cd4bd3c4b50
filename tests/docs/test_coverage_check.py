"""The documentation's coverage check (docs/ext/coverage_check.py), without a build: what
it requires, and that a missing entry, a vague docstring, an entry naming a private
module and an excuse no longer needed each fail it."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location(
        "coverage_check", ROOT / "docs" / "ext" / "coverage_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_it_requires_every_public_name_and_each_public_class_member(check):
    names = set(check.public_names())
    assert {"jaxstep", "jaxstep.make_train_step", "jaxstep.TrainStep.host_state"} <= names
    assert {"jaxstep.Status.GRAD_NONFINITE", "jaxstep.TrainState.params"} <= names  # members
    assert {"jaxstep.testing.Fault.leaf", "jaxstep.flax.nnx_split"} <= names
    assert {"jaxstep.distributed.reports.read", "jaxstep.launch.main"} <= names
    assert not [n for n in names if "._" in n]  # nothing private


def documented(check, drop=()):
    required = dict(check.public_objects())
    return required, set(required) - set(drop)


def test_a_public_name_without_an_entry_fails_it(check):
    required, entries = documented(check, drop={"jaxstep.read_emergency"})
    found = check.problems(required, entries, {})
    missing = "jaxstep.read_emergency is public and has no entry"
    assert any(line.startswith(missing) for line in found)


def test_an_entry_that_names_a_private_module_fails_it(check):
    required, entries = documented(check)
    found = check.problems(required, entries | {"jaxstep._src.loop._fit.fit"}, {})
    assert "jaxstep._src.loop._fit.fit has an entry but names a private module or member" in found
    assert not check.private_entries({"jaxstep.TrainStep.__call__"})  # dunders are public


def test_an_excuse_is_a_problem_once_it_is_no_longer_needed(check):
    required, entries = documented(check)
    found = check.problems(required, entries, {"jaxstep.restore": "why", "jaxstep.gone": "why"})
    needless = "jaxstep.restore is in conf.py's coverage_ignore but needs it no more: take it out"
    assert needless in found
    assert "jaxstep.gone is in conf.py's coverage_ignore but is not public" in found


def test_a_docstring_must_say_each_argument_and_what_comes_back(check, monkeypatch):
    def said(path: str, *, strict: bool = False, **options) -> int:
        """Reads a file.

        Args:
          path: the file.
          strict: refuse a short one.
          **options: passed on.

        Returns:
          Its length.
        """
        return 0

    def unsaid(path: str, strict: bool = False) -> int:
        """Reads a file.

        Args:
          path: the file.
        """
        return 0

    monkeypatch.setattr(check, "is_ours", lambda obj: True)
    assert check.unsaid(said) == []
    assert check.unsaid(unsaid) == ["argument 'strict'", "what it returns"]
