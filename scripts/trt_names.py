#!/usr/bin/env python
"""Regenerate the committed lists of real TensorRT and pycuda Python names (run by hand).

Writes, under ``quantkit/backends/tensorrt/names/``:

* ``trt10.txt`` from ``tensorrt-cu12-bindings==10.16.1.11``
* ``trt11.txt`` from ``tensorrt-cu13-bindings==11.4.0.106``
* ``pycuda.txt`` from the ``pycuda==2026.1`` source distribution

One name per line: ``Name`` for a module-level name, ``Class.member`` for a member
and ``Class.Nested.member`` one level deeper (``ILogger.Severity.WARNING``). The
backend's name check (tests/backends/tensorrt/test_names.py) and the recording fake
read these lists; CI never runs this script.

How the TensorRT names are read
-------------------------------
The bindings wheel is ``tensorrt_bindings/__init__.py`` plus one pybind11 extension,
``tensorrt.so``. The extension cannot be loaded as shipped: it links against
``libnvinfer.so.N``, ``libnvonnxparser.so.N`` and ``libnvinfer_plugin.so.N``, which
only the (multi-GB) libs wheel provides. But it imports only a handful of plain C
factory functions from them (``createInferBuilder_INTERNAL``, ``getPluginRegistry``,
...) and module initialisation never calls them - pybind11 only registers classes,
methods, properties and enum members. So the script

1. downloads the wheel with ``pip download --no-deps``;
2. reads the extension's ELF dynamic symbol table and DT_NEEDED list, and compiles
   (with the system C compiler) tiny stub libraries with those sonames that define
   every undefined function symbol the process cannot resolve, as ``return 0``;
3. imports ``tensorrt_bindings`` (the same package ``import tensorrt`` re-exports
   with ``from tensorrt_bindings import *``) in a subprocess with the stubs on
   ``LD_LIBRARY_PATH``, and lists ``dir()`` of the module and of every class: the
   exact names Python code sees, including the additions made by ``__init__.py``
   (``Logger.WARNING``, ``DataType.itemsize``, ``__version__``);
4. cross-checks against the extension's ``.rodata`` string table, where pybind11
   keeps every registered name as a NUL-terminated C string: each name that the
   import reports must also be there (``__init__.py`` additions excepted);
5. asserts known facts (``IInt8EntropyCalibrator2`` in 10.x and not in 11.x,
   ``IExecutionContext.execute_async_v3`` in both, ``BuilderFlag.INT8`` in 10.x only).

Nothing of TensorRT itself runs: the stubs are never called, and no GPU is needed.

How the pycuda names are read
-----------------------------
pycuda publishes only a source distribution. Its Python surface is declared with
Boost.Python in ``src/wrapper/wrap_cudadrv.cpp`` (``py::class_<..>("Name")`` followed by
``.def("m", ..)``, ``.DEF_SIMPLE_METHOD(m)``, ``.add_property("p", ..)``; module functions
via ``py::def("f", ..)`` / ``DEF_SIMPLE_FUNCTION(f)``), plus Python additions in
``pycuda/driver.py``. The script scans those declarations in order (members attach to
the class most recently declared) and checks the result against known names.

Usage::

    python scripts/trt_names.py [--out quantkit/backends/tensorrt/names] [--keep WORKDIR]

Needs: network access to the package index, a C compiler (``cc``), Python 3.11
(the bindings wheels are per-Python-version; pip picks the running interpreter's).
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import json
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "quantkit" / "backends" / "tensorrt" / "names"

TRT_WHEELS = {
    "trt10": "tensorrt-cu12-bindings==10.16.1.11",
    "trt11": "tensorrt-cu13-bindings==11.4.0.106",
}
PYCUDA_SDIST = "pycuda==2026.1"

# facts the extraction must reproduce, or it is broken
EXPECT = {
    "trt10": {"present": ["IInt8EntropyCalibrator2", "IExecutionContext.execute_async_v3", "BuilderFlag.INT8",
                          "BuilderFlag.OBEY_PRECISION_CONSTRAINTS", "IBuilderConfig.set_calibration_profile",
                          "ILayer.precision", "NetworkDefinitionCreationFlag.STRONGLY_TYPED", "__version__",
                          "Logger.WARNING"],
              "absent": ["IExecutionContext.execute_async_v2", "BuilderFlag.NOT_A_FLAG"]},
    "trt11": {"present": ["IExecutionContext.execute_async_v3", "NetworkDefinitionCreationFlag.STRONGLY_TYPED",
                          "IBuilderConfig.set_memory_pool_limit", "__version__"],
              "absent": ["IInt8EntropyCalibrator2", "BuilderFlag.INT8", "BuilderFlag.FP16",
                         "IBuilderConfig.int8_calibrator", "ILayer.precision", "ILayer.set_output_type"]},
    "pycuda": {"present": ["init", "Device.retain_primary_context", "Context.push", "Context.pop",
                           "pagelocked_empty", "mem_alloc", "memcpy_htod_async", "memcpy_dtoh_async",
                           "Stream.handle", "Stream.synchronize", "Event.record", "Event.time_till",
                           "DeviceAllocation.free", "Device.compute_capability", "Error"],
               "absent": ["Stream.begin_capture"]},
}

# ---------------------------------------------------------------------------- ELF reading


class Elf:
    """Just enough of a 64-bit little-endian ELF reader: sections, dynamic symbols, DT_NEEDED."""

    def __init__(self, data: bytes):
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise ValueError("not a 64-bit little-endian ELF file")
        self.data = data
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        names_offset = raw[shstrndx][4]
        self.sections = {}
        for name_off, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in raw:
            name = self._cstring(names_offset + name_off)
            self.sections[name] = (offset, size, link, entsize, sh_type)

    def _cstring(self, offset: int) -> str:
        end = self.data.index(b"\0", offset)
        return self.data[offset:end].decode("utf-8", "replace")

    def section(self, name: str) -> bytes:
        offset, size, *_ = self.sections[name]
        return self.data[offset:offset + size]

    def undefined_symbols(self) -> list[str]:
        """Undefined, non-weak dynamic symbols (what the library needs from others)."""
        offset, size, _link, entsize, _ = self.sections[".dynsym"]
        strtab = self.sections[".dynstr"][0]
        names = []
        for pos in range(offset, offset + size, entsize or 24):
            st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", self.data, pos)
            binding = st_info >> 4
            if st_shndx == 0 and st_name and binding != 2:  # SHN_UNDEF, not STB_WEAK
                names.append(self._cstring(strtab + st_name))
        return names

    def needed(self) -> list[str]:
        """DT_NEEDED sonames."""
        offset, size, *_ = self.sections[".dynamic"]
        strtab = self.sections[".dynstr"][0]
        needed = []
        for pos in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", self.data, pos)
            if tag == 0:
                break
            if tag == 1:
                needed.append(self._cstring(strtab + value))
        return needed

    def read_only_strings(self) -> bytes:
        """The read-only data sections, where C string literals live."""
        return b"\0".join(self.section(name) for name in self.sections if name.startswith(".rodata"))


# ---------------------------------------------------------------------------- TensorRT


def pip_download(spec: str, dest: Path, *extra: str) -> Path:
    """Download one distribution (no dependencies) and return the file."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.iterdir())
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                    "-q", "-d", str(dest), *extra, spec], check=True)
    new = sorted(set(dest.iterdir()) - before) or sorted(dest.iterdir())
    name = re.split(r"[=<>!]", spec)[0].replace("-", "_").lower()
    matches = [p for p in new if p.name.lower().replace("-", "_").startswith(name)]
    if not matches:
        raise SystemExit(f"pip download {spec}: no file found in {dest}")
    return matches[0]


def resolvable(symbol: str, libraries: list[ctypes.CDLL]) -> bool:
    return any(hasattr(lib, symbol) for lib in libraries)


def build_stubs(extension: Path, stub_dir: Path, compiler: str) -> list[str]:
    """Stub libraries for the extension's unresolvable DT_NEEDED entries; returns the stubbed symbols."""
    elf = Elf(extension.read_bytes())
    system = [ctypes.CDLL(None)]
    for soname in ("libstdc++.so.6", "libgcc_s.so.1", "libm.so.6"):
        try:
            system.append(ctypes.CDLL(soname))
        except OSError:
            pass
    missing_libs = []
    for soname in elf.needed():
        try:
            ctypes.CDLL(soname)
        except OSError:
            missing_libs.append(soname)
    symbols = sorted(s for s in set(elf.undefined_symbols()) if not resolvable(s, system))
    stub_dir.mkdir(parents=True, exist_ok=True)
    source = stub_dir / "stubs.c"
    source.write_text("\n".join(f"void *{name}(void) {{ return 0; }}" for name in symbols) + "\n")
    for soname in missing_libs:
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(stub_dir / soname), str(source)], check=True)
    return symbols


_DUMP = r"""
import inspect, json, sys, types
import tensorrt_bindings as t
names = {"__version__"}
for name in dir(t):
    if name.startswith("_"):
        continue
    obj = getattr(t, name)
    if isinstance(obj, types.ModuleType):
        continue
    names.add(name)
    if not inspect.isclass(obj):
        continue
    for member in dir(obj):
        if member.startswith("_"):
            continue
        names.add(f"{name}.{member}")
        inner = getattr(obj, member, None)
        if inspect.isclass(inner) and inner.__module__.startswith("tensorrt"):
            names.update(f"{name}.{member}.{m}" for m in dir(inner) if not m.startswith("_"))
json.dump(sorted(names), sys.stdout)
"""


def init_py_names(init_py: Path) -> set[str]:
    """Names that tensorrt_bindings/__init__.py itself defines (not in the .so's strings)."""
    tree = ast.parse(init_py.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                elif isinstance(target, ast.Attribute):
                    names.add(target.attr)
        elif isinstance(node, ast.For):  # loop variables left in the module namespace
            names.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
    return names


def tensorrt_names(spec: str, work: Path, compiler: str) -> tuple[list[str], str]:
    """The Python names of one bindings wheel, cross-checked against its string table."""
    wheel = pip_download(spec, work / "wheels", "--only-binary=:all:")
    unpacked = work / wheel.stem
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    package = unpacked / "tensorrt_bindings"
    extension = next(package.glob("tensorrt*.so"))
    stub_dir = work / f"stubs-{wheel.stem}"
    build_stubs(extension, stub_dir, compiler)
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(stub_dir), "PYTHONPATH": str(unpacked)}
    result = subprocess.run([sys.executable, "-c", _DUMP], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"importing {spec} against stub libraries failed:\n{result.stderr[-2000:]}")
    names = json.loads(result.stdout)

    # The linker merges string literals, so "INT8" may be stored as the tail of "UINT8": a name
    # is present when it occurs followed by a NUL, wherever it starts.
    strings = Elf(extension.read_bytes()).read_only_strings()
    from_init = init_py_names(package / "__init__.py") | {"name", "value"}  # pybind11 enum properties
    unexplained = sorted(n for n in names
                         if n.split(".")[-1] not in from_init and n.split(".")[-1].encode() + b"\0" not in strings)
    if unexplained:
        raise SystemExit(f"{spec}: {len(unexplained)} imported names are not in the extension's strings, "
                         f"e.g. {unexplained[:10]}: the extraction is not reliable")
    return names, f"{spec} ({wheel.name})"


# ---------------------------------------------------------------------------- pycuda

_BOOST_TOKEN = re.compile(
    r'py::class_<[^;]*?\(\s*"(?P<cls>\w+)"'                                  # class declaration
    r'|py::enum_<[^>]*>\(\s*"(?P<enum>\w+)"'                                # enum declaration
    r'|\.\s*(?:def|add_property|add_static_property|def_readonly|def_readwrite|staticmethod|value)'
    r'\(\s*"(?P<member>\w+)"'                                               # .def("name", ..)
    r'|\.\s*(?:DEF_SIMPLE_METHOD|DEF_SIMPLE_METHOD_WITH_ARGS|DEF_SIMPLE_RO_MEMBER|DEF_SIMPLE_RW_MEMBER'
    r'|ENUM_VALUE)\(\s*(?P<macro_member>\w+)'                               # .DEF_SIMPLE_METHOD(name)
    r'|(?<![.\w])(?:py::def|DEF_SIMPLE_FUNCTION|DEF_SIMPLE_FUNCTION_WITH_ARGS)\(\s*"?(?P<func>\w+)'
    r'|py::scope\(\)\.attr\("(?P<alias>\w+)"\)'
    r'|DECLARE_EXC\(\s*(?P<exc>\w+)', re.S)


def boost_python_names(source: str) -> set[str]:
    """Names declared by a Boost.Python wrapper file (see the module doc for the rules)."""
    source = re.sub(r"//[^\n]*", "", source)
    source = re.sub(r"^[ \t]*#define(?:[^\n]*\\\n)*[^\n]*", "", source, flags=re.M)  # macro bodies
    names: set[str] = set()
    current: str | None = None
    for match in _BOOST_TOKEN.finditer(source):
        kind = match.lastgroup
        value = match.group(kind)
        if kind in ("cls", "enum"):
            current = value
            names.add(value)
        elif kind in ("member", "macro_member"):
            if current is not None and not value.startswith("__"):
                names.add(f"{current}.{value}")
        elif kind == "func":
            names.add(value)
        elif kind == "alias":
            names.add(value)
        elif kind == "exc":
            names.add(value)
    return names


def driver_py_names(source: str) -> set[str]:
    """Module-level defs/classes/assignments of pycuda/driver.py and ``Class.attr = ...`` anywhere."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name) and not t.id.startswith("_"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id[:1].isupper() and not target.attr.startswith("_")):
                    names.add(f"{target.value.id}.{target.attr}")
    return names


def pycuda_names(work: Path) -> tuple[list[str], str]:
    # --no-build-isolation: pip prepares the sdist's metadata with the running environment's
    # setuptools and numpy instead of building numpy from source in an isolated one.
    sdist = pip_download(PYCUDA_SDIST, work / "sdist", "--no-binary=:all:", "--no-build-isolation")
    with tarfile.open(sdist) as archive:
        archive.extractall(work / "pycuda-src", filter="data")
    root = next((work / "pycuda-src").iterdir())
    names = boost_python_names((root / "src" / "wrapper" / "wrap_cudadrv.cpp").read_text())
    names |= driver_py_names((root / "pycuda" / "driver.py").read_text())
    return sorted(names), f"{PYCUDA_SDIST} ({sdist.name})"


# ---------------------------------------------------------------------------- main


def check_expectations(label: str, names: list[str]) -> None:
    present = set(names)
    wrong = [f"missing {n}" for n in EXPECT[label]["present"] if n not in present]
    wrong += [f"unexpected {n}" for n in EXPECT[label]["absent"] if n in present]
    if wrong:
        raise SystemExit(f"{label}: extraction disagrees with known facts: {', '.join(wrong)}")


def write_list(path: Path, names: list[str], source: str) -> None:
    header = (f"# {path.stem}: Python names of {source}\n"
              "# generated by scripts/trt_names.py - do not edit; one name per line, Class.member for members\n")
    path.write_text(header + "\n".join(names) + "\n")
    print(f"wrote {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}: {len(names)} names")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--keep", type=Path, help="work folder to keep (default: a temporary one)")
    parser.add_argument("--cc", default=shutil.which("cc") or "gcc", help="C compiler for the stub libraries")
    parser.add_argument("--only", choices=[*TRT_WHEELS, "pycuda"], action="append", help="regenerate only these")
    args = parser.parse_args(argv)
    wanted = args.only or [*TRT_WHEELS, "pycuda"]
    work = args.keep or Path(tempfile.mkdtemp(prefix="trt-names-"))
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        for label in wanted:
            if label == "pycuda":
                names, source = pycuda_names(work)
            else:
                names, source = tensorrt_names(TRT_WHEELS[label], work / label, args.cc)
            check_expectations(label, names)
            write_list(args.out / f"{label}.txt", names, source)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
