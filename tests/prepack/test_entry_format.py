"""The metadata_props record of pre-packed weights: round trips, key injectivity, strictness."""

from __future__ import annotations

import copy
import hashlib
import json
import zlib
from urllib.parse import unquote

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnxpack.errors import PrepackFormatError
from onnxpack.prepack import entry_format as ef
from onnxpack.prepack.entry_format import BufferRecord, PackRecord, WeightRecord

# -- strategies ---------------------------------------------------------------------------------

names = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=20,
)
tricky = st.one_of(names, st.sampled_from(["a/b", "/", "//", "%", "%2F", "%252F", "a%2Fb", "é/ü", "名前/重み", " ", "."]))
hexd = st.integers(8, 16).flatmap(lambda n: st.binary(min_size=n, max_size=n)).map(bytes.hex)


@st.composite
def buffers(draw):
    dtype = draw(st.sampled_from(sorted(ef.ALLOWED_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 50), max_size=4)))
    return BufferRecord(
        location=draw(st.sampled_from(["model.data", "weights/w.bin", "ü.bin"])),
        offset=64 * draw(st.integers(0, 2**40)),
        length=int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize,
        dtype=dtype,
        shape=shape,
        checksum=f"{draw(st.integers(0, 2**32 - 1)):08x}",
    )


@st.composite
def weight_records(draw):
    npacks = draw(st.integers(1, 3))
    keys = draw(st.lists(st.tuples(st.sampled_from(["matmul", "conv", "gemm"]), st.integers(0, 99), hexd), min_size=npacks, max_size=npacks, unique=True))
    packs = tuple(
        PackRecord(key=f"{f}/{v}/{d}", buffers=tuple(draw(st.lists(buffers(), min_size=1, max_size=3))))
        for f, v, d in keys
    )
    return WeightRecord(
        scope=draw(tricky),
        name=draw(tricky.filter(bool)),
        source_length=draw(st.integers(0, 2**40)),
        source_offset=draw(st.one_of(st.none(), st.integers(0, 2**40))),
        source_digest=draw(hexd),
        packs=packs,
    )


@given(weight_records())
@settings(max_examples=150, deadline=None)
def test_round_trip(record):
    key, value = ef.format_record(record)
    assert ef.is_record_key(key)
    assert value.startswith("onnxpack-prepack-v1;")
    assert len(value) <= ef.MAX_VALUE_LENGTH
    assert ef.parse_record(key, value) == record
    # The key decodes (with the standard library, independently) to the scope and the name.
    scope_enc, name_enc = key[len(ef.KEY_PREFIX) :].split("/")
    assert (unquote(scope_enc), unquote(name_enc)) == (record.scope, record.name)


@given(tricky, tricky.filter(bool), tricky, tricky.filter(bool))
@settings(max_examples=300, deadline=None)
def test_keys_never_collide(s1, n1, s2, n2):
    same = ef.record_key(s1, n1) == ef.record_key(s2, n2)
    assert same == ((s1, n1) == (s2, n2))


@pytest.mark.parametrize(
    "pairs",
    [
        [("a/b", "c"), ("a", "b/c"), ("", "a/b/c"), ("a/b/c", "x")],
        [("a%2Fb", "c"), ("a/b", "c"), ("a%252Fb", "c")],
        [("", "%"), ("", "%25"), ("%", ""+"x"), ("%25", "x")],
        [("é", "w"), ("e\u0301", "w"), ("", "é/w")],
    ],
    ids=["slashes", "percent", "percent-literal", "unicode"],
)
def test_tricky_keys_distinct_and_round_trip(pairs):
    keys = [ef.record_key(s, n) for s, n in pairs]
    assert len(set(keys)) == len(keys)
    for (s, n), k in zip(pairs, keys):
        rec = _record(scope=s, name=n)
        key, value = ef.format_record(rec)
        assert key == k
        got = ef.parse_record(key, value)
        assert (got.scope, got.name) == (s, n)
        # A record moved under another weight's key is rejected (the value is the truth).
        for other in keys:
            if other != k:
                with pytest.raises(PrepackFormatError, match="metadata key"):
                    ef.parse_record(other, value)


# -- hand-made records and malformed values ------------------------------------------------------


def _record(scope="", name="W", **kw):
    buf = BufferRecord("model.data", 128, 4 * 6, "<f4", (2, 3), "0000abcd")
    pack = PackRecord("matmul/1/" + "ab" * 8, (buf,))
    args = dict(scope=scope, name=name, source_length=24, source_offset=64, source_digest="cd" * 16, packs=(pack,))
    args.update(kw)
    return WeightRecord(**args)


def _good_json():
    key, value = ef.format_record(_record())
    return key, json.loads(value.split(";", 1)[1])


def _value(obj):
    return "onnxpack-prepack-v1;" + json.dumps(obj, separators=(",", ":"))


def _buf(o):
    return o["packs"][0]["buffers"][0]


def _set(path, val):
    def f(o):
        t = o
        for p in path[:-1]:
            t = t[p]
        t[path[-1]] = val

    return f


def _del(path):
    def f(o):
        t = o
        for p in path[:-1]:
            t = t[p]
        del t[path[-1]]

    return f


B = ("packs", 0, "buffers", 0)
MUTATIONS = {
    "missing-scope": _del(("scope",)),
    "missing-source": _del(("source",)),
    "missing-digest": _del(("source", "digest")),
    "missing-packs": _del(("packs",)),
    "missing-pack-key": _del(("packs", 0, "key")),
    "missing-buffer-crc": _del(B + ("crc32",)),
    "missing-buffer-shape": _del(B + ("shape",)),
    "unknown-field": _set(("extra",), 1),
    "unknown-buffer-field": _set(B + ("extra",), 1),
    "scope-not-str": _set(("scope",), 3),
    "name-empty": _set(("name",), ""),
    "name-nul": _set(("name",), "a\x00b"),
    "name-too-long": _set(("name",), "x" * (ef.MAX_NAME_BYTES + 1)),
    "source-not-object": _set(("source",), [1, 2, 3]),
    "source-negative-offset": _set(("source", "offset"), -1),
    "source-length-float": _set(("source", "length"), 24.0),
    "source-length-bool": _set(("source", "length"), True),
    "source-overflow": _set(("source", "offset"), 2**63 - 10),
    "digest-upper": _set(("source", "digest"), "CD" * 16),
    "digest-short": _set(("source", "digest"), "cd" * 4),
    "digest-odd": _set(("source", "digest"), "c" * 33),
    "packs-empty": _set(("packs",), []),
    "packs-not-list": _set(("packs",), {"a": 1}),
    "packs-too-many": lambda o: o.__setitem__("packs", [dict(copy.deepcopy(o["packs"][0]), key=f"matmul/{i}/" + "ab" * 8) for i in range(ef.MAX_PACKS + 1)]),
    "packs-duplicate-key": lambda o: o["packs"].append(copy.deepcopy(o["packs"][0])),
    "pack-key-bad": _set(("packs", 0, "key"), "matmul/1"),
    "pack-key-slash-family": _set(("packs", 0, "key"), "mat/mul/1/" + "ab" * 8),
    "pack-key-not-str": _set(("packs", 0, "key"), 5),
    "buffers-empty": _set(("packs", 0, "buffers"), []),
    "buffers-too-many": lambda o: o["packs"][0].__setitem__("buffers", [copy.deepcopy(_buf(o))] * (ef.MAX_BUFFERS_PER_PACK + 1)),
    "buffer-not-object": _set(B, "x"),
    "offset-negative": _set(B + ("offset",), -64),
    "offset-unaligned": _set(B + ("offset",), 130),
    "offset-overflow": _set(B + ("offset",), 2**63),
    "offset-plus-length-overflow": lambda o: _buf(o).update(offset=2**63 - 64, shape=[100], length=400),
    "offset-str": _set(B + ("offset",), "128"),
    "offset-null": _set(B + ("offset",), None),
    "length-mismatch": _set(B + ("length",), 25),
    "length-negative": _set(B + ("length",), -24),
    "shape-negative": _set(B + ("shape",), [-2, -3]),
    "shape-float": _set(B + ("shape",), [2.0, 3]),
    "shape-not-list": _set(B + ("shape",), 6),
    "too-many-dims": _set(B + ("shape",), [1] * (ef.MAX_DIMS + 1)),
    "dtype-big-endian": _set(B + ("dtype",), ">f4"),
    "dtype-object": _set(B + ("dtype",), "|O"),
    "dtype-bool": _set(B + ("dtype",), "|b1"),
    "dtype-complex": _set(B + ("dtype",), "<c8"),
    "dtype-name": _set(B + ("dtype",), "float32"),
    "checksum-int": _set(B + ("crc32",), 1234),
    "checksum-long": _set(B + ("crc32",), "0000abcd0"),
    "location-absolute": _set(B + ("file",), "/etc/passwd"),
    "location-dotdot": _set(B + ("file",), "../x.bin"),
    "location-dotdot-inner": _set(B + ("file",), "a/../../x.bin"),
    "location-backslash": _set(B + ("file",), "..\\x.bin"),
    "location-drive": _set(B + ("file",), "C:x.bin"),
    "location-empty": _set(B + ("file",), ""),
    "location-nul": _set(B + ("file",), "a\x00.bin"),
}


@pytest.mark.parametrize("mutate", list(MUTATIONS.values()), ids=list(MUTATIONS))
def test_malformed_field_rejected(mutate):
    key, obj = _good_json()
    mutate(obj)
    with pytest.raises(PrepackFormatError) as ei:
        ef.parse_record(key, _value(obj))
    msg = str(ei.value)
    assert key in msg and "expected" in msg and "got" in msg


RAW = {
    "foreign-magic": "something-else;{}",
    "no-magic-json": "{}",
    "unknown-version": "onnxpack-prepack-v2;{}",
    "version-leading-zero": "onnxpack-prepack-v01;{}",
    "version-no-semicolon": "onnxpack-prepack-v1{}",
    "version-not-number": "onnxpack-prepack-vx;{}",
    "bad-json": "onnxpack-prepack-v1;{",
    "json-array": "onnxpack-prepack-v1;[]",
    "json-nan": None,  # filled below
    "json-duplicate-field": None,
    "huge-integer": None,
    "deep-nesting": "onnxpack-prepack-v1;" + "[" * 100000 + "]" * 100000,
    "too-long": "onnxpack-prepack-v1;" + " " * ef.MAX_VALUE_LENGTH,
}


def _raw_cases():
    key, obj = _good_json()
    good = _value(obj)
    cases = dict(RAW)
    cases["json-nan"] = good.replace('"offset":128', '"offset":NaN')
    cases["json-duplicate-field"] = good.replace('"offset":128', '"offset":128,"offset":192')
    cases["huge-integer"] = good.replace('"offset":128', '"offset":1' + "0" * 5000)
    assert cases["json-nan"] != good and cases["json-duplicate-field"] != good
    return key, cases


@pytest.mark.parametrize("case", list(RAW), ids=list(RAW))
def test_malformed_value_rejected(case):
    key, cases = _raw_cases()
    with pytest.raises(PrepackFormatError, match="expected"):
        ef.parse_record(key, cases[case])


@pytest.mark.parametrize(
    "key",
    ["onnxpack.other/x/W", "W", "onnxpack.prepacked/" + "a" * ef.MAX_KEY_LENGTH, 7, "onnxpack.prepacked//V"],
    ids=["foreign-prefix", "no-prefix", "too-long", "not-str", "other-weight"],
)
def test_bad_key_rejected(key):
    _, value = ef.format_record(_record())
    with pytest.raises(PrepackFormatError):
        ef.parse_record(key, value)


def test_value_not_str_rejected():
    key, value = ef.format_record(_record())
    with pytest.raises(PrepackFormatError):
        ef.parse_record(key, value.encode())


def test_writer_refuses_what_parser_would_refuse():
    buf = BufferRecord("d" * 4000, 0, 4, "<f4", (1,), "00000000")
    packs = tuple(PackRecord(f"matmul/{i}/" + "ab" * 8, (buf,) * ef.MAX_BUFFERS_PER_PACK) for i in range(ef.MAX_PACKS))
    with pytest.raises(PrepackFormatError, match="at most"):
        ef.format_record(_record(packs=packs))
    with pytest.raises(PrepackFormatError):
        ef.record_key("", "\ud800")  # lone surrogate: not encodable as UTF-8


@pytest.mark.parametrize(
    "make",
    [
        lambda: BufferRecord("m.bin", 0, 8, "<f4", (3,), "00000000"),
        lambda: BufferRecord("m.bin", 0, 12, "<f4", [3], "00000000"),
        lambda: PackRecord("matmul/1/" + "ab" * 8, ()),
        lambda: PackRecord("matmul/1/" + "ab" * 8, ("x",)),
        lambda: _record(packs=()),
        lambda: _record(source_offset=-1),
        lambda: _record(name=""),
    ],
    ids=["length", "shape-list", "no-buffers", "not-buffer", "no-packs", "negative-source", "empty-name"],
)
def test_invalid_records_cannot_be_built(make):
    with pytest.raises(PrepackFormatError):
        make()


# -- bounds, views and helpers -------------------------------------------------------------------


def test_check_bounds():
    rec = _record()  # buffer at [128, 152) of model.data
    ef.check_bounds(rec, 152)
    ef.check_bounds(rec, {"model.data": 152})
    with pytest.raises(PrepackFormatError, match="file size 151"):
        ef.check_bounds(rec, 151)
    with pytest.raises(PrepackFormatError, match="model.data"):
        ef.check_bounds(rec, {"other.data": 10**9})


def test_buffer_view_and_helpers():
    data = bytearray(256)
    arr = np.arange(6, dtype="<f4").reshape(2, 3)
    data[128:152] = arr.tobytes()
    rec = ef.buffer_record(arr, "model.data", 128)
    assert rec == BufferRecord("model.data", 128, 24, "<f4", (2, 3), f"{zlib.crc32(arr.tobytes()):08x}")
    view = rec.view(bytes(data))
    np.testing.assert_array_equal(view, arr)
    assert not view.flags.writeable
    with pytest.raises(PrepackFormatError, match="file size 150"):
        rec.view(bytes(data[:150]))
    # Big-endian input is recorded (and checksummed) as its little-endian bytes.
    be = np.arange(3, dtype=">i4")
    rec_be = ef.buffer_record(be, "m.bin", 0)
    assert rec_be.dtype == "<i4" and rec_be.checksum == f"{zlib.crc32(np.arange(3, dtype='<i4').tobytes()):08x}"
    # Empty buffers view as empty arrays of the right shape.
    empty = BufferRecord("m.bin", 0, 0, "<f8", (0, 4), "00000000").view(b"")
    assert empty.shape == (0, 4) and empty.dtype == np.float64
    assert ef.digest_bytes(arr) == hashlib.blake2b(arr.tobytes(), digest_size=16).hexdigest()
    assert ef.checksum(arr[:, ::2]) == f"{zlib.crc32(np.ascontiguousarray(arr[:, ::2]).tobytes()):08x}"
    assert ef.split_pack_key("matmul/3/" + "0f" * 8) == ("matmul", 3, "0f" * 8)


# -- the one-expression accepts agree with the field-by-field checks ---------------------------------
# Each record type accepts a valid record with one expression and runs its field-by-field checks
# (``_explain``) only to name what is wrong: the expression must never accept what they refuse.

_ints = st.one_of(st.integers(-2, 2**64), st.sampled_from([0, 64, 128, 2**62, 2**63 - 64, True, 1.0, "64", None]))
_texts = st.one_of(tricky, st.sampled_from(["", "a\x00b", "é" * 5000, "x" * 5000, "../up", "/abs", "C:w", 7, None, b"w"]))
_hex = st.one_of(hexd, st.sampled_from(["", "0" * 15, "0" * 17, "A" * 16, "0" * 130, "0" * 128, "0g" * 8, 16, None]))


def _raw(cls, **fields):
    """An instance whose fields are set without running ``__post_init__``."""
    obj = object.__new__(cls)
    for k, v in fields.items():
        object.__setattr__(obj, k, v)
    return obj


def _explains(obj) -> bool:
    try:
        obj._explain()
    except PrepackFormatError:
        return False
    return True


@given(st.one_of(_texts, st.sampled_from(["model.data", "w.bin"])), _ints, _ints,
       st.sampled_from([*sorted(ef.ALLOWED_DTYPES), "<f16", "O", 4, None]),
       st.one_of(st.lists(_ints, max_size=9).map(tuple), st.just([2, 3]), st.just((2**40, 2**40))),
       st.one_of(st.integers(0, 2**32 - 1).map("{:08x}".format), _hex))
@settings(max_examples=400, deadline=None)
def test_buffer_fast_accept_never_accepts_what_the_checks_refuse(location, offset, length, dtype, shape, checksum):
    # A location is accepted in one step once the checks have passed it (a remembered location).
    assert _explains(_raw(BufferRecord, location="model.data", offset=0, length=4, dtype="<f4", shape=(1,),
                          checksum="0" * 8))
    b = _raw(BufferRecord, location=location, offset=offset, length=length, dtype=dtype, shape=shape, checksum=checksum)
    if ef._buffer_ok(b):
        assert _explains(b)


@given(st.one_of(_texts, st.sampled_from(["mm/1/" + "0" * 32, "m.m-_/123456789/" + "ab" * 64, "mm/1/" + "0" * 33])),
       st.one_of(st.lists(buffers(), max_size=17).map(tuple), st.just([]), st.just(("x",))))
@settings(max_examples=200, deadline=None)
def test_pack_fast_accept_never_accepts_what_the_checks_refuse(key, bufs):
    p = _raw(PackRecord, key=key, buffers=bufs)
    b = p.buffers
    fast = (type(b) is tuple and 0 < len(b) <= ef.MAX_BUFFERS_PER_PACK and ef._pack_key_match(p.key) is not None
            and all(type(x) is BufferRecord for x in b))
    if fast:
        assert _explains(p)


@given(_texts, _texts, _ints, st.one_of(st.none(), _ints), _hex,
       st.one_of(st.lists(st.sampled_from(["mm/1/" + "0" * 32, "mm/1/" + "1" * 32]), max_size=17).map(
           lambda ks: tuple(PackRecord(key=k, buffers=(BufferRecord("d", 0, 4, "<f4", (1,), "0" * 8),)) for k in ks)),
           st.just([]), st.just(("p",))))
@settings(max_examples=400, deadline=None)
def test_weight_fast_accept_never_accepts_what_the_checks_refuse(scope, name, length, offset, digest, packs):
    r = _raw(WeightRecord, scope=scope, name=name, source_length=length, source_offset=offset, source_digest=digest,
             packs=packs)
    if ef._weight_ok(r):
        assert _explains(r)


def test_fast_accepts_take_the_records_the_writer_makes():
    # The other direction, on what the saver writes: the one expression accepts them (else
    # every warm load would pay for the field-by-field checks).
    b = BufferRecord("model.onnx.data", 9191424, 516096, "|u1", (516096,), "e70bf715")
    p = PackRecord("matmulnbits/2/40ae43bbae26c60642b163f3427ff5c1", (b,))
    w = WeightRecord("", "model.layers.0.attn.qkv_proj.MatMul.weight_Q4", 516096, 8675328, "8d" * 32, (p,))
    assert ef._buffer_ok(b) and ef._pack_key_match(p.key) and ef._weight_ok(w)


# -- the record index (manifest version 2) -------------------------------------------------------
# The manifest a save appends to the data file also holds every record as fixed-size rows; a warm
# load builds a trusted file's records from it instead of their JSON.  It must give exactly the
# records the JSON parses to, and whatever its bytes, never a record the checked constructors
# would refuse.

def _props(records):
    return [ef.format_record(r) for r in records]


def _checked(rec: WeightRecord) -> WeightRecord:
    """``rec`` built again through the checking constructors (raises if any field breaks a rule)."""
    packs = tuple(PackRecord(p.key, tuple(BufferRecord(b.location, b.offset, b.length, b.dtype, b.shape, b.checksum)
                                          for b in p.buffers)) for p in rec.packs)
    return WeightRecord(rec.scope, rec.name, rec.source_length, rec.source_offset, rec.source_digest, packs)


@given(st.lists(weight_records(), min_size=1, max_size=6, unique_by=lambda r: (r.scope, r.name)))
@settings(max_examples=100, deadline=None)
def test_record_index_gives_the_records_json(records):
    props = _props(records)
    man = ef.manifest_bytes(props)
    assert man[:16] == ef.MANIFEST_MAGIC_V2
    assert ef.parse_manifest(man) == {kd: vd for kd, vd in (ef._entry(k, v) for k, v in props)}
    index = ef.RecordIndex(man)
    for (key, value), rec in zip(props, records):
        row = index.row(ef._entry(key, value)[0])
        if any(not all(b.shape) for p in rec.packs for b in p.buffers):
            assert row is None  # an empty buffer: left to the JSON
            continue
        assert row is not None
        got = index.record(row)
        assert got == rec == ef.parse_record(key, value)
        assert index.names(row) == (rec.scope, rec.name)


def test_version_1_manifests_still_parse_and_have_no_index():
    props = _props([_record()])
    man = ef.manifest_bytes(props)
    entries = man[ef.MANIFEST_HEADER:ef.MANIFEST_HEADER + ef.MANIFEST_ENTRY]
    v1 = ef.MANIFEST_MAGIC + (1).to_bytes(8, "little") + bytes(ef.MANIFEST_HEADER - 24) + entries
    assert ef.parse_manifest(v1) == ef.parse_manifest(man)
    with pytest.raises(PrepackFormatError, match="version 2"):
        ef.RecordIndex(v1)


def test_records_the_index_cannot_hold_are_left_to_their_json():
    """Two records under one key, a record that does not parse: no row (the JSON path decides)."""
    good = ef.format_record(_record(name="A"))
    bad = (ef._key_of("", "B"), "onnxpack-prepack-v1;{}")
    dup = [ef.format_record(_record(name="C")), ef.format_record(_record(name="C", source_length=8))]
    index = ef.RecordIndex(ef.manifest_bytes([good, bad, *dup]))
    assert index.row(ef._entry(*good)[0]) is not None
    for k, v in (bad, *dup):
        assert index.row(ef._entry(k, v)[0]) is None


def _damaged(records, flips, *, index_only: bool) -> tuple[bytearray, ef.RecordIndex | None]:
    """The manifest of ``records`` with bytes set by ``flips`` ((position, value); positions in
    the record index only, or anywhere), and its RecordIndex (None: refused with a format error)."""
    man = bytearray(ef.manifest_bytes(_props(records)))
    start = int.from_bytes(man[24:32], "little") if index_only else 0
    for pos, val in flips:
        man[start + pos % (len(man) - start)] = val
    try:
        return man, ef.RecordIndex(bytes(man))
    except PrepackFormatError:
        return man, None


@given(st.lists(weight_records(), min_size=1, max_size=4, unique_by=lambda r: (r.scope, r.name)),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8),
       st.sampled_from(["index", "anywhere"]))
@settings(max_examples=300, deadline=None)
def test_damaged_index_never_builds_a_record_the_checks_refuse(records, flips, where):
    """Bytes of the manifest changed (the index's rows, counts and text, or anywhere): either the
    index is refused with a format error, or every record it builds passes every check of the
    record constructors (it skips them, having checked the rows in bulk)."""
    man, index = _damaged(records, flips, index_only=where == "index")
    if index is None:
        return
    count = int.from_bytes(man[16:24], "little")
    for i in range(count):
        kd = bytes(man[ef.MANIFEST_HEADER + ef.MANIFEST_ENTRY * i:][:16])
        row = index.row(kd)
        if row is not None:
            rec = index.record(row)
            assert _checked(rec) == rec


@given(st.lists(weight_records(), min_size=1, max_size=4, unique_by=lambda r: (r.scope, r.name)),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=0, max_size=6))
@settings(max_examples=100, deadline=None)
def test_index_row_texts_fast_path_equals_the_careful_one(records, flips):
    """The index checks the common row (ASCII text, one pack) inline; on every row, intact or with
    bytes of the index changed, its verdict and texts equal ``_texts_of``'s, row by row."""
    _, index = _damaged(records, flips, index_only=True)
    if index is None:
        return
    careful = []
    for w in index._wl:
        try:
            careful.append(index._texts_of(w, {}))
        except UnicodeDecodeError:
            careful.append(None)
    assert index._texts == careful
