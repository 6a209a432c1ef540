"""Native code cache: JIT kernels compiled once by numba, loaded later without it.

Why: a process that imports numba and loads even one cached kernel pays ~23 MB of private memory
for numba's modules and ~27 MB more for its runtime (typing registries, the NRT module compiled
at start-up), and ~0.8 s of CPU (measured, numba 0.68 / Python 3.11).  Four processes serving one
int4 LLM pay it four times: that, not the weights (mapped once), is most of what they do not
share.  llvmlite alone — the LLVM binding numba itself uses — loads an object file and hands out
its functions' addresses for ~5 MB and ~50 ms.

How: kernel modules that support it (:mod:`._nbits_jit`) define C-ABI entry points with
``numba.cfunc`` taking one pointer to an int64 *argument block* (addresses, sizes and float
parameters, laid out by their Python-side twin) and never allocating (the caller passes every
scratch buffer, so the code never calls numba's runtime).  A process that has numba compiles
them and writes their object code here (:func:`save`); a later process loads it (:func:`load`)
and calls the entries through ctypes, which releases the GIL.  Parallel entries are OpenMP
workers run by ``GOMP_parallel`` of the system's GNU OpenMP (the library numba's own ``omp``
threading layer uses), each taking work items from a dynamic loop: a thread that the OS
deschedules while another process holds its core leaves its items to the others instead of
stalling the call.

**A shared library when the system linker allows.**  llvmlite's loader relocates the code into
private anonymous memory, and importing llvmlite and initializing LLVM costs ~9 MB of private
memory per process (measured: the Private_Dirty of a fresh process, before and after).  So the
build also links the object code into a shared object with the system's ``ld`` (binutils; numba's
runtime functions, which these kernels never reach, bound to ``abort`` by a stub object that
llvmlite compiles), and a later process opens it with ``dlopen`` (ctypes): ~0.6 MB of private
memory, code pages shared with every other process through the page cache, no llvmlite import.
Without ``ld``, or when the library does not open here, the object code serves through llvmlite
as before.

The file (one per kernel module) lives in the code cache folder — ``ONNXPACK_CODE_CACHE``, else
``$XDG_CACHE_HOME/onnxpack/native``, else ``~/.cache/onnxpack/native`` — named by a fingerprint
of everything the code depends on: the kernel module's and this module's source, the numba,
llvmlite and Python versions, the CPU (on Linux the identity and feature flags of
``/proc/cpuinfo``, read without llvmlite; elsewhere LLVM's host CPU name and features).  Any change picks another name, so a
stale file is never loaded.  Layout: :data:`MAGIC`, an 8-byte little-endian header length, a
JSON header (entries -> symbols, undefined symbols, object length and SHA-256, and the shared
library's length and SHA-256 when one was linked), the object code.  The shared library is the
same name with ``.so``; it is opened only when its bytes match the header.  A file that does not verify is reported once (a warning) and ignored; the kernels then run
through numba and the file is rewritten.  Like numba's own cache and Python's ``__pycache__``,
the folder is trusted: whoever can write it can run code as the user.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import platform
import struct
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from onnxpack._io import atomic_write

__all__ = ["cache_dir", "gomp_library", "fingerprint", "path_for", "save", "load", "intact", "Native", "GOMP"]

logger = logging.getLogger(__name__)

MAGIC = b"onnxpack-native-v1\n"
GOMP = "libgomp.so.1"
_ENV_DIR = "ONNXPACK_CODE_CACHE"
_lock = threading.Lock()
_engines: list[Any] = []  # shared libraries and llvmlite engines, kept alive for the process's lifetime
_warned: set[str] = set()


def cache_dir() -> str:
    """The code cache folder (not created here)."""
    env = os.environ.get(_ENV_DIR, "")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME", "") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "onnxpack", "native")


_gomp: list[str] = []  # [what gomp_library() names], once looked up


def gomp_library() -> str:
    """What to open for GNU OpenMP (the parallel entries' runtime): its soname when the dynamic
    loader opens it as it is, else what ``ctypes.util.find_library`` finds (which runs
    ``ldconfig -p`` in a child process: ~10 ms and ~0.5 MB of imports at every process's first
    native load, for the name the loader already knew)."""
    if not _gomp:
        try:
            ctypes.CDLL(GOMP)
            name = GOMP
        except OSError:
            from ctypes import util

            name = util.find_library("gomp") or GOMP
        _gomp.append(name)
    return _gomp[0]


def _version(dist: str) -> str:
    """The installed version of the distribution ``dist`` ("absent" without it).

    Read from the one ``<dist>-<version>.dist-info`` folder beside the importable package, as pip
    installs it: ``importlib.metadata`` would give the same but costs ~20 ms and ~1.6 MB of
    imports (email, csv, zipfile) in every process that loads the code cache.  Anything else
    (an egg, an editable install, several candidates) asks importlib.metadata."""
    spec = importlib.util.find_spec(dist)
    if spec is None:
        return "absent"
    where = spec.submodule_search_locations
    origin = (list(where)[0] if where else spec.origin) or ""
    site = os.path.dirname(os.path.abspath(origin)) if origin else ""
    prefix, suffix = f"{dist}-", ".dist-info"
    try:
        found = [n[len(prefix):-len(suffix)] for n in os.listdir(site) if n.startswith(prefix) and n.endswith(suffix)]
    except OSError:
        found = []
    if len(found) == 1 and found[0] and "-" not in found[0]:
        return found[0]
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _llvm():
    """llvmlite's binding, initialized for the host (None when llvmlite is missing)."""
    try:
        import llvmlite.binding as llvm
    except ImportError:
        return None
    with _lock:
        if not getattr(_llvm, "done", False):
            try:  # llvmlite >= 0.44 initializes LLVM itself and rejects the call
                llvm.initialize()
            except RuntimeError:
                pass
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            _llvm.done = True  # type: ignore[attr-defined]
    return llvm


_CPUINFO = "/proc/cpuinfo"
_CPUINFO_KEYS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags", "Features", "CPU implementer",
                 "CPU architecture", "CPU variant", "CPU part", "isa")


_cpuinfo: dict[str, dict[str, str]] = {}  # path -> the first processor's fields, read once


def _cpuinfo_fields(cached: bool = True) -> dict[str, str]:
    """The identity and feature fields of the first processor in ``/proc/cpuinfo`` ({} where
    there is none); read once unless ``cached`` is False."""
    fields = _cpuinfo.get(_CPUINFO) if cached else None
    if fields is None:
        try:
            with open(_CPUINFO, encoding="utf-8", errors="replace") as f:
                first = f.read(1 << 16).split("\n\n", 1)[0]
        except OSError:
            first = ""
        fields = {}
        for line in first.splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() in _CPUINFO_KEYS:
                fields[key.strip()] = " ".join(value.split())
        _cpuinfo[_CPUINFO] = fields
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (``avx2``, ``avx512f``, ...), read without
    llvmlite; empty where ``/proc/cpuinfo`` is missing (callers then take their portable path)."""
    fields = _cpuinfo_fields()
    return frozenset((fields.get("flags") or fields.get("Features") or fields.get("isa") or "").split())


def _cpu_identity() -> list[str] | None:
    """What the compiled code depends on of the CPU: on Linux the identity and feature flags of
    the first processor in ``/proc/cpuinfo`` (no llvmlite import: LLVM's host detection reads the
    same CPUID bits the kernel lists); elsewhere LLVM's host CPU name and features (None when
    llvmlite is missing)."""
    fields = _cpuinfo_fields(cached=False)  # (read when a cache file is named: rarely)
    if fields.get("flags") or fields.get("Features") or fields.get("isa"):
        return ["cpuinfo", *(f"{k}={fields[k]}" for k in sorted(fields))]
    llvm = _llvm()
    if llvm is None:
        return None
    return ["llvm", llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()]


def fingerprint(sources: Sequence[str]) -> str | None:
    """Hex digest naming the cache file of the kernels compiled from ``sources`` (file paths);
    None when the CPU cannot be described (no ``/proc/cpuinfo`` and no llvmlite)."""
    cpu = _cpu_identity()
    if cpu is None:
        return None
    h = hashlib.sha256(MAGIC)
    for path in (*sources, __file__):
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    h.update(json.dumps([_version("numba"), _version("llvmlite"), sys.version, platform.machine(), cpu]).encode())
    return h.hexdigest()[:32]


def path_for(module: str, sources: Sequence[str]) -> str | None:
    """The cache file of ``module`` compiled from ``sources`` on this machine (None: see
    :func:`fingerprint`)."""
    fp = fingerprint(sources)
    return None if fp is None else os.path.join(cache_dir(), f"{module}-{fp}.bin")


def save(module: str, sources: Sequence[str], entries: Mapping[str, Any], expected: str | None = None) -> str | None:
    """Write the object code of the numba cfuncs ``entries`` (name -> cfunc) for ``module``.

    Runs in a process that has numba.  ``expected``: the cache file named before the sources
    were imported and compiled; when the sources changed since (an upgrade or an edit while a
    background build ran), the code compiled is not what the file name promises and nothing is
    written.  Returns the file written, or None when the folder cannot be written or the sources
    changed (logged; the kernels keep running through numba)."""
    path = path_for(module, sources)
    if path is None:
        return None
    if expected is not None and path != expected:
        logger.info("native code cache not written: %s's sources changed while it was compiled", module)
        return None
    objects, symbols, undefined = [], {}, set()
    for name, cf in entries.items():
        lib = cf._library  # numba's CodeLibrary of the cfunc: its object code and its LLVM module
        _, kind, data = lib.serialize_using_object_code()
        if kind != "object":  # pragma: no cover - numba changed its serialization
            logger.info("native cache: numba gave %r code for %s; not cached", kind, name)
            return None
        objects.append(data[0])
        symbols[name] = [len(objects) - 1, cf.native_name]
        mod = lib._final_module
        undefined.update(f.name for f in mod.functions if f.is_declaration)
        undefined.update(g.name for g in mod.global_variables if g.is_declaration)
    fields = {"entries": symbols, "undefined": sorted(undefined),
              "objects": [[len(o), hashlib.sha256(o).hexdigest()] for o in objects]}
    shared = _link(objects, sorted(undefined), [s for _, s in symbols.values()])
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        if shared is not None:  # the library first: a header never names a library not yet written
            atomic_write(shared_path(path), lambda f: f.write(shared))
            fields["shared"] = [len(shared), hashlib.sha256(shared).hexdigest()]
    except OSError as exc:
        logger.info("native cache: cannot write %s (%s); the object code will serve", shared_path(path), exc)
    header = json.dumps(fields).encode()

    def write(f) -> None:
        f.write(MAGIC)
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for o in objects:
            f.write(o)

    try:
        atomic_write(path, write)
    except OSError as exc:
        logger.info("native cache: cannot write %s (%s); kernels keep running through numba", path, exc)
        return None
    return path


def shared_path(path: str) -> str:
    """The shared library linked from the cache file ``path``'s object code."""
    return path[:-len(".bin")] + ".so" if path.endswith(".bin") else path + ".so"


def _stub_object(llvm, names: Sequence[str]) -> bytes:
    """Object code defining each of ``names`` as a function that calls ``abort``: the numba
    runtime symbols that the cfunc wrappers name on error paths these kernels never take."""
    ir = ["declare void @abort() noreturn nounwind"]
    ir += [f'define void @"{n}"() noreturn nounwind {{\n  call void @abort()\n  unreachable\n}}' for n in names]
    module = llvm.parse_assembly("\n".join(ir))
    module.verify()
    machine = llvm.Target.from_default_triple().create_target_machine(reloc="pic")
    return machine.emit_object(module)


def _link(objects: Sequence[bytes], undefined: Sequence[str], symbols: Sequence[str]) -> bytes | None:
    """The object codes linked into one shared library by the system linker, or None (no ``ld``,
    no llvmlite, or a library that does not open or lacks an entry here: logged).  Symbols the
    process provides at load time stay undefined: the Python C API, GNU OpenMP's, libc's and
    libm's; any other (numba's runtime and helpers) is bound to ``abort``."""
    import shutil  # (a build's imports: loading the cache needs none of them)
    import subprocess
    import tempfile

    ld = shutil.which("ld")
    llvm = _llvm()
    if ld is None or llvm is None:
        return None
    process = ctypes.CDLL(None)
    stubs = [n for n in undefined if not n.startswith(("llvm.", "GOMP_", "omp_"))
             and not hasattr(ctypes.pythonapi, n) and not hasattr(process, n)]
    try:
        with tempfile.TemporaryDirectory(prefix="onnxpack-link-") as tmp:
            names = []
            for i, obj in enumerate([*objects, _stub_object(llvm, stubs)]):
                names.append(os.path.join(tmp, f"{i}.o"))
                with open(names[-1], "wb") as f:
                    f.write(obj)
            out = os.path.join(tmp, "kernels.so")
            run = subprocess.run([ld, "-shared", "-z", "noexecstack", "-o", out, *names], capture_output=True,
                                 text=True, timeout=300, stdin=subprocess.DEVNULL)
            if run.returncode != 0:
                logger.info("native cache: ld failed (%s); the object code will serve", run.stderr.strip()[-500:])
                return None
            if any(n.startswith(("GOMP_", "omp_")) for n in undefined):
                ctypes.CDLL(gomp_library(), mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(out)
            if not all(ctypes.cast(lib[sym], ctypes.c_void_p).value for sym in symbols):
                return None
            with open(out, "rb") as f:
                return f.read()
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.info("native cache: no shared library (%s); the object code will serve", exc)
        return None


def _read(path: str) -> tuple[dict, list[bytes]]:
    """Header and object codes of a cache file; ValueError when it does not verify."""
    with open(path, "rb") as f:
        blob = f.read()
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 8:
        raise ValueError("not an onnxpack native code file")
    (hlen,) = struct.unpack_from("<Q", blob, len(MAGIC))
    start = len(MAGIC) + 8
    if hlen > len(blob) - start:
        raise ValueError(f"header length {hlen} exceeds the file")
    header = json.loads(blob[start:start + hlen])
    pos, objects = start + hlen, []
    for length, digest in header["objects"]:
        obj = blob[pos:pos + int(length)]
        if len(obj) != int(length) or hashlib.sha256(obj).hexdigest() != digest:
            raise ValueError("object code does not match its digest (truncated or altered)")
        objects.append(obj)
        pos += int(length)
    if pos != len(blob):
        raise ValueError(f"{len(blob) - pos} bytes after the last object")
    for name, (index, symbol) in header["entries"].items():
        if not (isinstance(index, int) and 0 <= index < len(objects) and isinstance(symbol, str)):
            raise ValueError(f"entry {name!r} is malformed")
    shared = header.get("shared")
    if shared is not None and not (isinstance(shared, list) and len(shared) == 2 and isinstance(shared[0], int)
                                   and isinstance(shared[1], str)):
        raise ValueError("the shared library's record is malformed")
    return header, objects


def _shared_ok(path: str, header: dict) -> bool:
    """Whether the shared library that ``header`` names is next to ``path`` with those bytes."""
    length, digest = header["shared"]
    try:
        with open(shared_path(path), "rb") as f:
            blob = f.read(length + 1)
    except OSError:
        return False
    return len(blob) == length and hashlib.sha256(blob).hexdigest() == digest


def intact(path: str) -> bool:
    """Whether ``path`` is a cache file that verifies, with its shared library when it names one
    (a damaged one is rebuilt over)."""
    try:
        header, _ = _read(path)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return "shared" not in header or _shared_ok(path, header)


def _helperlib():
    """numba's C helper library, opened without importing numba (its error-path helpers)."""
    spec = importlib.util.find_spec("numba")
    if spec is None or spec.origin is None:
        return None
    import glob

    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "_helperlib*"))
    try:
        return ctypes.CDLL(found[0]) if found else None
    except OSError:
        return None


def _resolve(llvm, names: Sequence[str]) -> bool:
    """Make every undefined symbol of the object code resolvable.  Process symbols and GNU
    OpenMP's are looked up; the Python C API and numba's helpers (used only on the error paths
    that numba's cfunc wrappers always contain) come from ctypes; any other symbol — numba
    runtime functions these allocation-free kernels never reach — is bound to ``abort``.
    Returns False when GNU OpenMP is needed but missing."""
    if any(n.startswith(("GOMP_", "omp_")) for n in names):
        try:
            llvm.load_library_permanently(gomp_library())
        except RuntimeError:
            return False
    helper = _helperlib()
    libc = ctypes.CDLL(None)
    for name in names:
        if name.startswith("llvm.") or llvm.address_of_symbol(name):
            continue  # LLVM intrinsics are no symbols
        addr = None
        for lib in (ctypes.pythonapi, helper):
            if lib is not None and hasattr(lib, name):
                addr = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                break
        if addr is None:
            addr = ctypes.cast(libc.abort, ctypes.c_void_p).value
        llvm.add_symbol(name, addr)
    return True


def load(module: str, sources: Sequence[str]) -> dict[str, int] | None:
    """Entry name -> function address for ``module``'s cached native code, or None when there is
    none usable here (no llvmlite, no file, a file that does not verify: warned once)."""
    if os.environ.get("ONNXPACK_DISABLE_NATIVE", "") == "1":
        return None
    path = path_for(module, sources)
    if path is None or not os.path.isfile(path):
        return None
    try:
        header, objects = _read(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _warn_once(path, f"native code cache {path} is unusable ({exc}); using numba and rewriting it")
        return None
    if "shared" in header:
        if _shared_ok(path, header):
            addresses = _open_shared(shared_path(path), header)
            if addresses is not None:
                return addresses
        else:
            _warn_once(shared_path(path), f"native code library {shared_path(path)} does not match its cache file; "
                                          "loading the object code instead (the cache is rebuilt)")
    llvm = _llvm()
    if llvm is None:
        return None
    with _lock:
        if not _resolve(llvm, header["undefined"]):
            return None
        target = llvm.Target.from_default_triple().create_target_machine(jit=True)
        addresses = {}
        for index, obj in enumerate(objects):
            engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), target)
            engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
            engine.finalize_object()
            _engines.append(engine)
            for name, (i, symbol) in header["entries"].items():
                if i == index:
                    addresses[name] = engine.get_function_address(symbol)
    if not all(addresses.values()):
        return None
    return addresses


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning("%s", message)


def _open_shared(path: str, header: dict) -> dict[str, int] | None:
    """Entry name -> address in the shared library at ``path`` (opened once, kept open), or
    None when it does not open here (logged; the object code serves)."""
    try:
        with _lock:
            if any(n.startswith(("GOMP_", "omp_")) for n in header["undefined"]):
                ctypes.CDLL(gomp_library(), mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(path)
            _engines.append(lib)
        addresses = {name: ctypes.cast(lib[symbol], ctypes.c_void_p).value
                     for name, (_, symbol) in header["entries"].items()}
    except (OSError, AttributeError) as exc:
        logger.info("native code library %s does not open here (%s); loading the object code", path, exc)
        return None
    return addresses if all(addresses.values()) else None


class Native:
    """Callable entries of a loaded native module: ``call(name, block)`` runs an entry on the
    calling thread, ``parallel(name, block, threads)`` runs an OpenMP worker entry on a team of
    ``threads`` (the caller included).  ``block`` is a C-contiguous int64 array."""

    _gomp = None

    def __init__(self, addresses: Mapping[str, int]) -> None:
        proto = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        self.addresses = dict(addresses)
        self._fns = {name: proto(addr) for name, addr in addresses.items()}
        self._teams: dict[str, Callable[[int, int], None]] = {}  # name -> parallel_entry(name)
        self.used_openmp = False

    def call(self, name: str, block_address: int) -> None:
        self._fns[name](block_address)

    def entry(self, name: str) -> Callable[[int], None]:
        """The entry ``name`` as a callable of the block's address (``call`` without the look-up)."""
        return self._fns[name]

    def parallel(self, name: str, block_address: int, threads: int) -> None:
        run = self._teams.get(name)
        if run is None:
            run = self._teams[name] = self.parallel_entry(name)
        run(block_address, threads)

    def parallel_entry(self, name: str) -> Callable[[int, int], None]:
        """The OpenMP worker ``name`` as a callable of ``(block_address, threads)`` that runs it on
        a team of ``threads`` (``GOMP_parallel``; the calling thread works too)."""
        gomp = Native._gomp
        if gomp is None:
            gomp = ctypes.CDLL(gomp_library())
            gomp.GOMP_parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
            gomp.GOMP_parallel.restype = None
            Native._gomp = gomp
        self.used_openmp = True  # from here on a forked child must not use the team (see quant)
        run, worker = gomp.GOMP_parallel, self.addresses[name]

        def parallel(block_address: int, threads: int) -> None:
            run(worker, block_address, threads, 0)

        return parallel
