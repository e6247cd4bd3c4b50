"""The documentation's coverage check (docs/ext/coverage_check.py), without a build: what
it requires, and that a missing entry, a vague docstring, a value that would show a
builtin's docstring, an entry naming a private module and an excuse no longer needed each
fail it."""

import importlib.util
import inspect
import pathlib
import types

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


def test_a_value_that_would_show_a_builtins_docstring_fails_it(check):
    # jaxstep.distributed's ENV_COORDINATOR once had no #: comment: its entry and its
    # summary read "str(object='') -> str".
    fake = types.ModuleType("jaxstep.fake")
    required = {"jaxstep.fake": fake, "jaxstep.fake.ENV_X": "JAXSTEP_X", "jaxstep.fake.N": 75}
    found = check.problems(required, set(required), {})
    assert found == [
        "jaxstep.fake.ENV_X's entry shows Python's docstring of str: describe it in a #: "
        "comment above the assignment that defines it",
        "jaxstep.fake.N's entry shows Python's docstring of int: describe it in a #: "
        "comment above the assignment that defines it",
    ]
    # A class's fields are its docstring's Attributes, whatever their values' types.
    assert check.borrowed({"jaxstep.Recover": object, "jaxstep.Recover.retries": 1}) == {}


def test_every_public_value_is_described_where_it_is_defined(check):
    assert check.borrowed(dict(check.public_objects())) == {}


def test_autodoc_shows_the_defining_comment_not_the_builtins_docstring(check):
    import jaxstep

    lines = inspect.cleandoc(int.__doc__).splitlines()
    check.own_words(None, "data", "jaxstep.RESTART_EXIT_CODE", 75, None, lines)
    assert lines[0] == (
        "The exit code (75, ``EX_TEMPFAIL`` in sysexits.h: a temporary failure, try again)"
    )
    assert lines == check.defining_comment("jaxstep.RESTART_EXIT_CODE", jaxstep.RESTART_EXIT_CODE)
    words = ["The colour of a failure.", ""]  # a #: comment autodoc found stays
    check.own_words(None, "data", "jaxstep.plot.FAILURE_COLOR", "#e41a1c", None, words)
    assert words == ["The colour of a failure.", ""]


def test_a_public_function_or_class_without_an_example_fails_it(check):
    def shown() -> None:
        """Does it.

        Example:
          >>> shown()
        """

    def block() -> None:
        """Does it in several processes.

        Example::

            block()
        """

    def bare() -> None:
        """Does it."""

    class Bare:
        """A thing."""

        def method(self) -> None:
            """A member needs no example of its own."""

    class Shown:
        """A thing.

        >>> Shown()
        """

    class Heir(Shown):  # an inherited docstring is not its own
        pass

    fake = types.ModuleType("jaxstep.fake")
    objects = {"shown": shown, "block": block, "bare": bare, "Bare": Bare, "Heir": Heir}
    for obj in objects.values():
        obj.__module__ = "jaxstep.fake"
    required = {"jaxstep.fake": fake, "jaxstep.fake.Bare.method": Bare.method}
    required |= {f"jaxstep.fake.{name}": obj for name, obj in objects.items()}
    found = check.problems(required, set(required), {})
    assert found == [
        f"jaxstep.fake.{name} has no example in its docstring: add an Example section with "
        ">>> lines (run as a doctest; a :: code block only where nothing runs in one process)"
        for name in ("Bare", "Heir", "bare")
    ]
    # An excuse covers it while it is needed, and is a problem once it is not.
    excused = {"jaxstep.fake.Bare": "why", "jaxstep.fake.Heir": "why", "jaxstep.fake.bare": "why"}
    assert check.problems(required, set(required), excused) == []
    found = check.problems(required, set(required), excused | {"jaxstep.fake.shown": "why"})
    assert found == [
        "jaxstep.fake.shown is in conf.py's coverage_ignore but needs it no more: take it out"
    ]


def test_every_public_function_and_class_has_an_example(check):
    assert check.without_example(dict(check.public_objects())) == []
