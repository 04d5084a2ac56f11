"""Tier 1: targets inherited from a base class, and the markers on wrapt proxies.

A target named on a subclass but defined on its base must reach the patch as the
raw entry found along the MRO (a ``classmethod`` stays a classmethod), so the
replacement binds as the original did; ``unapply`` then deletes the subclass's
entry again.  Each test runs in a forked child with its own engine (the real
``Engine``, the ``selftest`` patch) on a target module written to ``tmp_path``.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from support.selftest import write_manifest, write_target

INHERIT_SOURCE = '''
class Base:
    @classmethod
    def make(cls):
        return f"made by {cls.__name__}"

    @staticmethod
    def tool(x):
        return f"tool {x}"

    def hi(self):
        return f"hi from {type(self).__name__}"

    @property
    def value(self):
        """The value."""
        return f"value of {type(self).__name__}"


class Sub(Base):
    pass


class SubSub(Sub):
    pass


def greet(name, punctuation="!"):
    """Say hello."""
    return f"hello {name}{punctuation}"
'''

NAMES = ("make", "tool", "hi", "value")


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """A fresh engine over a manifest naming ``Sub.<name>`` for each name, plus ``greet``."""
    for var in ("DRAMA3_PATCHES", "DRAMA3_PATCHES_DISABLE", "DRAMA3_PATCHES_STRICT", "DRAMA3_PATCHES_REPORT_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DRAMA3_PATCHES_PLATFORM", "cpu")
    write_target(tmp_path, "d3p_inherit", INHERIT_SOURCE)
    targets = [f"d3p_inherit:Sub.{n}" for n in NAMES] + ["d3p_inherit:greet"]
    manifest = write_manifest(tmp_path, {"targets": targets})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DRAMA3_PATCHES_MANIFEST", str(manifest))

    from drama3_patches.engine import Engine
    from drama3_patches.manifest import load_manifest

    module = importlib.import_module("d3p_inherit")
    eng = Engine(load_manifest(manifest))
    eng.activate(force=True)  # late start: the module is imported, so the targets patch now
    return eng, module


def _behaviour(m, name) -> list:
    """What each kind answers on the subclass, a grandchild and the base (base: never patched)."""
    Base, Sub, SubSub = m.Base, m.Sub, m.SubSub
    calls = {
        "make": lambda: [Sub.make(), SubSub.make(), Sub().make(), Base.make()],
        "tool": lambda: [Sub.tool(1), SubSub().tool(2), Base.tool(3)],
        "hi": lambda: [Sub().hi(), SubSub().hi(), Base().hi()],
        "value": lambda: [Sub().value, SubSub().value, Base().value],
    }
    try:
        return calls[name]()
    except TypeError as exc:  # what an inherited classmethod installed as a plain function gives
        return [f"TypeError: {exc}"]


PATCHED = {
    "make": ["made by Sub [patched]", "made by SubSub [patched]", "made by Sub [patched]", "made by Base"],
    "tool": ["tool 1 [patched]", "tool 2 [patched]", "tool 3"],
    "hi": ["hi from Sub [patched]", "hi from SubSub [patched]", "hi from Base"],
    "value": ["value of Sub [patched]", "value of SubSub [patched]", "value of Base"],
}
ORIGINAL = {
    "make": ["made by Sub", "made by SubSub", "made by Sub", "made by Base"],
    "tool": ["tool 1", "tool 2", "tool 3"],
    "hi": ["hi from Sub", "hi from SubSub", "hi from Base"],
    "value": ["value of Sub", "value of SubSub", "value of Base"],
}


@pytest.mark.forked
@pytest.mark.parametrize("name", NAMES)
def test_inherited_descriptor_keeps_its_kind(engine, name):
    eng, m = engine
    status = {p["id"]: p for p in eng.status()["patches"]}["selftest"]
    assert status["target_states"][f"d3p_inherit:Sub.{name}"]["state"] == "applied"
    assert _behaviour(m, name) == PATCHED[name]
    # The original handed to the patch, and kept for unapply, is the base's raw entry.
    assert eng.get_original(f"d3p_inherit:Sub.{name}") is m.Base.__dict__[name]


@pytest.mark.forked
@pytest.mark.parametrize("name", NAMES)
def test_unapply_removes_the_subclass_entry_again(engine, name):
    eng, m = engine
    base_entry = m.Base.__dict__[name]
    assert name in m.Sub.__dict__
    eng.unapply()
    assert name not in m.Sub.__dict__  # inherited again, not shadowed by a copy
    assert m.Base.__dict__[name] is base_entry
    assert _behaviour(m, name) == ORIGINAL[name]
    eng.activate(force=True)  # and it applies again, one layer
    assert _behaviour(m, name) == PATCHED[name]


@pytest.mark.forked
def test_wrapt_proxy_marker_stays_off_the_original(engine):
    eng, m = engine
    original = eng.get_original("d3p_inherit:greet")
    assert type(m.greet).__name__ == "FunctionWrapper"
    assert m.greet.__wrapped__ is original
    assert eng.is_ours(m.greet) == "selftest"
    # wrapt writes attribute sets through to the wrapped object: none may land there.
    assert "__drama3_patch__" not in vars(original)
    assert eng.is_ours(original) is None
    assert str(inspect.signature(m.greet)) == "(name, punctuation='!')"
    eng.unapply()
    assert m.greet is original and m.greet("x") == "hello x!"
    eng.activate(force=True)  # an original that looked ours would be taken as already patched
    assert m.greet("x") == "hello x! [patched]"


@pytest.mark.forked
def test_wrap_keeps_a_widened_signature_off_the_original():
    from drama3_patches.patchlib import function_wrapper, wrap

    def original(a, b=1):
        return a + b

    widened = inspect.signature(lambda a, b=1, *, extra=None: None)

    @wrap(original, signature=widened)
    def replacement(a, b=1, *, extra=None):
        return original(a, b)

    assert str(inspect.signature(replacement)) == "(a, b=1, *, extra=None)"
    assert str(inspect.signature(original)) == "(a, b=1)"
    assert "__signature__" not in vars(original)
    # A proxy would carry the new signature onto the original: wrap() refuses one.
    proxy = function_wrapper(original, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    with pytest.raises(TypeError, match="plain function"):
        wrap(original, signature=widened)(proxy)
    assert "__signature__" not in vars(original)
