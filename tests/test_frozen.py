"""``onnxpack._frozen.fast_init``: the same constructor as ``dataclasses`` generates, cheaper.

Oracle: the same class definition decorated by ``dataclasses`` alone — every construction (by
position, by keyword, with and without defaults, factories, keyword-only fields, ``__post_init__``,
``init=False`` fields, slots) must give equal field values, the same errors for bad calls, and
still refuse assignment afterwards.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from onnxpack._frozen import fast_init


def _pair(make):
    """(dataclasses' class, fast_init's class) from one class-body factory."""
    return make(), fast_init(make())


def _values(obj):
    out = {}
    for f in dataclasses.fields(obj):
        try:
            out[f.name] = getattr(obj, f.name)
        except AttributeError:
            out[f.name] = "<unset>"
    return out


def _plain(slots=False):
    @dataclasses.dataclass(frozen=True, slots=slots)
    class R:
        a: int
        b: str
        c: tuple = ()
        d: list = dataclasses.field(default_factory=list)
        e: int = dataclasses.field(default=7, init=False)
        f: dict = dataclasses.field(default_factory=dict, init=False, compare=False)
        g: int = dataclasses.field(default=0, kw_only=True)
        h: list = dataclasses.field(default_factory=lambda: [1], kw_only=True)

    return R


def _with_post_init(slots=False):
    @dataclasses.dataclass(frozen=True, slots=slots)
    class P:
        xs: tuple
        scale: float = 1.0
        total: float = dataclasses.field(init=False, repr=False, compare=False)

        def __post_init__(self):
            if not isinstance(self.xs, tuple):
                raise ValueError("xs must be a tuple")
            object.__setattr__(self, "total", sum(self.xs) * self.scale)

    return P


CALLS = [
    ((1, "x"), {}),
    ((1, "x", (2,)), {}),
    ((1,), {"b": "y", "d": [3], "g": 4}),
    ((), {"a": 1, "b": "z", "h": [9, 9]}),
    ((1, "x", (), [5]), {"g": 2, "h": []}),
    # bad calls: both must refuse them alike
    ((1,), {}),
    ((1, "x", (), [], 5), {}),
    ((1, "x"), {"e": 3}),
    ((1, "x"), {"a": 2}),
    ((1, "x"), {"nope": 1}),
]


@pytest.mark.parametrize("slots", [False, True])
@pytest.mark.parametrize("args,kwargs", CALLS)
def test_same_fields_and_errors_as_dataclasses(slots, args, kwargs):
    ref_cls, fast_cls = _pair(lambda: _plain(slots))
    try:
        ref = ref_cls(*args, **kwargs)
    except TypeError:
        with pytest.raises(TypeError):
            fast_cls(*args, **kwargs)
        return
    got = fast_cls(*args, **kwargs)
    assert _values(got) == _values(ref)
    assert repr(got).split("(", 1)[1] == repr(ref).split("(", 1)[1]
    if "d" not in kwargs and len(args) < 4:  # a factory's value: a fresh one per instance
        assert got.d == [] and got.d is not fast_cls(*args, **kwargs).d
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.a = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        del got.b


@pytest.mark.parametrize("slots", [False, True])
def test_post_init_runs_last_and_its_errors_pass_through(slots):
    ref_cls, fast_cls = _pair(lambda: _with_post_init(slots))
    for args in [((1, 2, 3),), ((1.5,), 2.0), ((),)]:
        assert _values(fast_cls(*args)) == _values(ref_cls(*args))
    with pytest.raises(ValueError, match="tuple"):
        fast_cls([1, 2])
    assert fast_cls((1, 2)) == fast_cls((1, 2)) and hash(fast_cls((1, 2))) == hash(fast_cls((1, 2)))


def test_signature_matches_dataclasses():
    ref_cls, fast_cls = _pair(_plain)
    ref, got = inspect.signature(ref_cls.__init__), inspect.signature(fast_cls.__init__)
    assert list(ref.parameters) == list(got.parameters)
    assert [p.kind for p in ref.parameters.values()] == [p.kind for p in got.parameters.values()]


def test_refuses_what_it_cannot_mirror():
    @dataclasses.dataclass
    class Mutable:
        a: int

    with pytest.raises(TypeError, match="not a frozen dataclass"):
        fast_init(Mutable)

    @dataclasses.dataclass(frozen=True)
    class WithInitVar:
        a: int
        extra: dataclasses.InitVar[int] = 0

        def __post_init__(self, extra):
            pass

    with pytest.raises(TypeError, match="InitVar"):
        fast_init(WithInitVar)


def test_the_hot_records_use_it_and_stay_frozen():
    """The records a warm create builds by the thousand (see the module docstring)."""
    from onnxpack.graph._external import ExternalLocation
    from onnxpack.prepack._sources import Obtained
    from onnxpack.prepack._weights import PrePackedWeights, WeightRef
    from onnxpack.prepack.entry_format import BufferRecord, PackRecord, WeightRecord
    from onnxpack.session._api import NodeArg
    from onnxpack.session._program import PackEvent, Step
    from onnxpack.session.kernels._base import KernelContext, TensorInfo

    for cls in (ExternalLocation, Obtained, PrePackedWeights, WeightRef, BufferRecord, PackRecord, WeightRecord,
                NodeArg, PackEvent, Step, KernelContext, TensorInfo):
        assert cls.__init__.__module__ == cls.__module__ and "__d" in cls.__init__.__code__.co_varnames \
            or "__set" in cls.__init__.__code__.co_names, cls
        assert cls.__dataclass_params__.frozen, cls
    info = TensorInfo(name="x", dtype=None, shape=(1, 2), elem_type=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.name = "y"
