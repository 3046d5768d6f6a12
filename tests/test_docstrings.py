"""Runs every `>>>` example in jdp's public docstrings (on 8 simulated devices)."""

import doctest
import importlib
import pkgutil

import pytest

import jdp

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(jdp.__path__, prefix="jdp.")
    if ".demo" not in m.name and not m.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(module, name, globs={}):
        if test.examples:
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_examples_are_found():
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = finder.find(importlib.import_module("jdp._parallel"), globs={})
    assert sum(len(t.examples) for t in tests) >= 10
