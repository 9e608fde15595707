#!/usr/bin/env python3
"""Build libmlxc (mlx-c) against the pip-installed MLX and generate the cffi declarations.

Run by `pip install` (the setuptools hook in setup.py) and runnable alone:

    python build_mlxc.py [--source PATH] [--force] [--output DIR]

Steps: check that the installed MLX is the release pyproject.toml pins, find the pinned mlx-c source (--source, the user cache, else the upstream archive), verify its
tree digest, apply the MLX 0.32 compatibility edits, build a shared libmlxc with CMake against the
`mlx` wheel's CMake config, then preprocess the installed headers with stand-in libc headers into a
cdef that `pymlxc.core._loader` hands to `ffi.cdef`, plus a JSON of every function's parameter names.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PIN_FILE = ROOT / "third_party" / "mlx-c.json"
PYPROJECT = ROOT / "pyproject.toml"
DEFAULT_OUTPUT = ROOT / "pymlxc" / "_lib"
STAMP_NAME = "stamp.json"
REBUILD_COMMAND = "python build_mlxc.py --force  (or: pip install -e .)"


class BuildError(RuntimeError):
    """A build step failed; the message says what to do."""


# ----------------------------------------------------------------------------- pin and cache

def load_pin() -> dict:
    return json.loads(PIN_FILE.read_text())


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pymlxc"


def cached_archive(pin: dict) -> Path:
    return cache_dir() / f"mlx-c-{pin['commit']}.tar.gz"


def tree_digest(tree: Path) -> str:
    """sha256 over sorted relative paths, each followed by NUL and the sha256 of the file's bytes."""
    digest = hashlib.sha256()
    files = sorted(
        str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file() and ".git" not in p.parts
    )
    for rel in files:
        digest.update(rel.encode() + b"\0")
        digest.update(hashlib.sha256((tree / rel).read_bytes()).digest())
    return digest.hexdigest()


def _is_git_dir(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def _extract_tarball(data: bytes, dest: Path) -> Path:
    """Extract a tarball into dest; return the source root (strips a single top-level folder)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        for member in tar.getmembers():
            if member.name.startswith("/") or ".." in Path(member.name).parts:
                raise BuildError(f"refusing unsafe path {member.name!r} in mlx-c tarball")
        tar.extractall(dest, filter="data") if sys.version_info >= (3, 12) else tar.extractall(dest)
    entries = [p for p in dest.iterdir()]
    if len(entries) == 1 and entries[0].is_dir() and not (dest / "mlx").exists():
        return entries[0]
    return dest


def _export_git(git_dir: Path, commit: str, dest: Path) -> Path:
    archive = subprocess.run(
        ["git", "--git-dir", str(git_dir), "archive", "--format=tar", commit],
        capture_output=True,
    )
    if archive.returncode != 0:
        raise BuildError(
            f"could not export mlx-c commit {commit} from git directory {git_dir}: "
            f"{archive.stderr.decode(errors='replace').strip()}"
        )
    return _extract_tarball(archive.stdout, dest)


def obtain_source(pin: dict, source: Path | None, workdir: Path) -> tuple[Path, str]:
    """Return (source tree, where it came from); the tree's digest is verified against the pin."""
    dest = workdir / "src"
    dest.mkdir(parents=True)
    if source is not None:
        source = source.expanduser().resolve()
        if not source.exists():
            raise BuildError(f"--source {source} does not exist")
        if source.is_dir() and (_is_git_dir(source) or _is_git_dir(source / ".git")):
            git_dir = source if _is_git_dir(source) else source / ".git"
            tree, origin = _export_git(git_dir, pin["commit"], dest), f"git directory {source}"
        elif source.is_dir():
            if not (source / "mlx" / "c" / "array.h").is_file():
                raise BuildError(f"--source {source} is not an mlx-c tree (no mlx/c/array.h)")
            tree = dest / "mlx-c"
            shutil.copytree(source, tree, ignore=shutil.ignore_patterns(".git", "build"))
            origin = f"directory {source}"
        else:
            tree, origin = _extract_tarball(source.read_bytes(), dest), f"tarball {source}"
    elif cached_archive(pin).is_file():
        tree = _extract_tarball(cached_archive(pin).read_bytes(), dest)
        origin = f"cache {cached_archive(pin)}"
    else:
        url = pin["archive_url"]
        print(f"[build_mlxc] downloading {url}", file=sys.stderr)
        try:
            with urllib.request.urlopen(url, timeout=120) as response:
                data = response.read()
        except OSError as exc:
            raise BuildError(
                f"mlx-c is not in {cache_dir()} and downloading {url} failed ({exc}). "
                "Pass a local copy with: python build_mlxc.py --source PATH"
            ) from exc
        tree, origin = _extract_tarball(data, dest), f"download {url}"
    found = tree_digest(tree)
    if found != pin["tree_sha256"]:
        raise BuildError(
            f"mlx-c source from {origin} does not match the pin in {PIN_FILE}: tree digest "
            f"{found}, expected {pin['tree_sha256']} (commit {pin['commit']})"
        )
    store_in_cache(pin, tree)
    return tree, origin


def store_in_cache(pin: dict, tree: Path) -> None:
    target = cached_archive(pin)
    if target.is_file():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(tree, arcname=f"mlx-c-{pin['commit']}")
    tmp.replace(target)


# ----------------------------------------------------------------------------- MLX and patches

def mlx_pins(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """{requirement, with where it stands: version} for every requirement on `mlx` in pyproject.toml.

    Each must be an exact `==` pin: libmlxc is built against the build environment's MLX and is
    refused at import by any other release, so a range would let pip pair it with the wrong one.
    """
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        data = tomllib.loads(pyproject.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BuildError(f"cannot read the MLX pins from {pyproject}: {exc}") from exc
    groups = {"[build-system] requires": data.get("build-system", {}).get("requires", []),
              "[project] dependencies": data.get("project", {}).get("dependencies", [])}
    for extra, reqs in data.get("project", {}).get("optional-dependencies", {}).items():
        groups[f"[project.optional-dependencies] {extra}"] = reqs
    pins: dict[str, str] = {}
    for where, reqs in groups.items():
        for text in reqs:
            try:
                req = Requirement(text)
            except InvalidRequirement as exc:
                raise BuildError(f"{pyproject}: {where}: {exc}") from exc
            if req.name.lower() != "mlx":
                continue
            specs = list(req.specifier)
            if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
                raise BuildError(f"{pyproject}: {where} requires {text!r}; MLX must be pinned exactly (mlx==X.Y.Z)")
            pins[f"{where}: {text}"] = specs[0].version
    return pins


def pinned_mlx_version(pyproject: Path = PYPROJECT) -> str:
    """The one MLX release pyproject.toml pins everywhere."""
    pins = mlx_pins(pyproject)
    versions = set(pins.values())
    if len(versions) != 1:
        listed = "; ".join(f"{where} -> {v}" for where, v in pins.items()) or "none"
        raise BuildError(f"{pyproject} must pin one MLX release in every requirement on mlx; found: {listed}")
    return versions.pop()


def check_mlx_version(installed: str, pinned: str, prefix: Path) -> None:
    if installed != pinned:
        raise BuildError(
            f"MLX {installed} is installed at {prefix}, but pymlxc is built and run with MLX {pinned} "
            f"(pinned in {PYPROJECT.name}). Install it: pip install 'mlx[cpu]=={pinned}' (Linux CPU), "
            f"'mlx[cuda13]=={pinned}' (CUDA) or 'mlx=={pinned}' (macOS); or let pip do it: pip install ."
        )


def find_mlx() -> tuple[Path, str]:
    """The installed mlx wheel's prefix (holding lib/, include/, share/cmake) and its version."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(
            "MLX is not installed in this Python. Install pymlxc with pip's build isolation (pip install .), "
            "which brings the pinned MLX, or install it first: pip install 'mlx[cpu]==X.Y.Z' (Linux CPU), "
            "'mlx[cuda13]==X.Y.Z' (CUDA) or 'mlx==X.Y.Z' (macOS), X.Y.Z as pinned in pyproject.toml"
        )
    prefix = Path(list(spec.submodule_search_locations)[0])
    if not (prefix / "share" / "cmake" / "MLX" / "MLXConfig.cmake").is_file():
        raise BuildError(f"the mlx package at {prefix} ships no CMake config (share/cmake/MLX)")
    return prefix, importlib.metadata.version("mlx")


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


# (file, old, new, why): applied when MLX >= 0.32. See third_party/COMPAT.md.
COMPAT_EDITS: list[tuple[str, str, str, str]] = [
    (
        "mlx/c/compile.cpp",
        "mlx::core::detail::compile_clear_cache();",
        "mlx::core::detail::compile_clear_cache(mlx::core::detail::compile_cache());",
        "MLX 0.32: compile_clear_cache takes the per-thread compile cache",
    ),
    (
        "mlx/c/compile.cpp",
        "mlx::core::detail::compile_erase(fun_id);",
        "mlx::core::detail::compile_erase(mlx::core::detail::compile_cache(), fun_id);",
        "MLX 0.32: compile_erase takes the per-thread compile cache first",
    ),
    (
        "mlx/c/fast.cpp",
        "            (sinks.ctx ? std::make_optional(mlx_array_get_(sinks))\n"
        "                       : std::nullopt),\n"
        "            mlx_stream_get_(s)));",
        "            (sinks.ctx ? std::make_optional(mlx_array_get_(sinks))\n"
        "                       : std::nullopt),\n"
        "            /* force_fused (new in MLX 0.32) = */ false,\n"
        "            mlx_stream_get_(s)));",
        "MLX 0.32: scaled_dot_product_attention gained force_fused before the stream",
    ),
    (
        "mlx/c/ops.cpp",
        "            std::string(mode),\n            sorted_indices,",
        "            std::string(mode),\n"
        "            /* global_scale (new in MLX 0.32) = */ std::nullopt,\n"
        "            sorted_indices,",
        "MLX 0.32: gather_qmm gained global_scale before sorted_indices",
    ),
]


def apply_compat_edits(tree: Path, mlx_version: str) -> list[str]:
    if _version_tuple(mlx_version) < (0, 32):
        return []
    applied = []
    for rel, old, new, why in COMPAT_EDITS:
        path = tree / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise BuildError(f"compat edit no longer applies to {rel} ({why}); update COMPAT_EDITS")
        path.write_text(text.replace(old, new))
        applied.append(why)
    return applied


# ----------------------------------------------------------------------------- CMake

def _require_tool(name: str, hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BuildError(f"{name} was not found on PATH; install it ({hint}) and run the build again")
    return path


def build_library(tree: Path, mlx_prefix: Path, workdir: Path, output: Path) -> Path:
    cmake = _require_tool("cmake", "apt install cmake, brew install cmake, or pip install cmake")
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        raise BuildError(
            "no C++ compiler (c++, g++ or clang++) was found; install one "
            "(apt install g++ on Debian/Ubuntu, xcode-select --install on macOS)"
        )
    build = workdir / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    rpath = f"{'@loader_path' if sys.platform == 'darwin' else '$ORIGIN'}/../../mlx/lib;{mlx_prefix / 'lib'}"
    configure = [
        cmake, "-S", str(tree), "-B", str(build), *generator,
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DMLX_C_BUILD_EXAMPLES=OFF",
        "-DMLX_C_USE_SYSTEM_MLX=ON",
        f"-DMLX_DIR={mlx_prefix / 'share' / 'cmake' / 'MLX'}",
        f"-DCMAKE_INSTALL_PREFIX={workdir / 'install'}",
        f"-DCMAKE_BUILD_RPATH={rpath}",
        f"-DCMAKE_INSTALL_RPATH={rpath}",
    ]
    jobs = str(max(1, os.cpu_count() or 1))
    for step in (configure, [cmake, "--build", str(build), "--parallel", jobs],
                 [cmake, "--install", str(build)]):
        print("[build_mlxc] " + " ".join(step), file=sys.stderr)
        result = subprocess.run(step, capture_output=True, text=True)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
            raise BuildError(f"command failed: {' '.join(step)}\n{tail}")
    install = workdir / "install"
    libs = [p for p in install.rglob("libmlxc*") if p.suffix in (".so", ".dylib") or ".so." in p.name]
    if not libs:
        raise BuildError(f"CMake installed no libmlxc under {install}")
    lib_name = "libmlxc.dylib" if sys.platform == "darwin" else "libmlxc.so"
    shutil.copy2(next(p for p in libs if not p.is_symlink()), output / lib_name)
    if (output / "include").exists():
        shutil.rmtree(output / "include")
    shutil.copytree(install / "include", output / "include")
    return output / lib_name


# ----------------------------------------------------------------------------- cdef generation

# Stand-in libc headers: just enough for the mlx-c headers, and all plain C that cffi parses.
FAKE_LIBC = {
    "stdint.h": "typedef signed char int8_t; typedef short int16_t; typedef int int32_t;"
    " typedef long long int64_t; typedef unsigned char uint8_t; typedef unsigned short uint16_t;"
    " typedef unsigned int uint32_t; typedef unsigned long long uint64_t;"
    " typedef unsigned long uintptr_t; typedef long intptr_t;",
    "stddef.h": "typedef unsigned long size_t;",
    "stdbool.h": "",
    "stdlib.h": "typedef unsigned long size_t;",
    "stdio.h": "typedef struct _IO_FILE FILE;",
    "float.h": "",
    "complex.h": "",
    # half.h only declares these on ARM; on x86-64 they appear in prototypes as opaque 16-bit
    # storage (only ever passed by pointer), so declare them as uint16_t for cffi.
    "arm_fp16.h": "",
    "arm_bf16.h": "",
}


def _preprocess(include_dir: Path, workdir: Path) -> str:
    fake = workdir / "fake_libc"
    fake.mkdir(exist_ok=True)
    for name, body in FAKE_LIBC.items():
        (fake / name).write_text(body + "\n")
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise BuildError("no C compiler (cc, gcc or clang) to preprocess the mlx-c headers; install gcc")
    result = subprocess.run(
        [cc, "-E", "-P", "-nostdinc", "-undef", "-U__aarch64__", "-I", str(fake), "-I", str(include_dir),
         str(include_dir / "mlx" / "c" / "mlx.h")],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise BuildError(f"preprocessing the mlx-c headers failed:\n{result.stderr[-3000:]}")
    return result.stdout


def generate_cdef(include_dir: Path, workdir: Path) -> tuple[str, dict]:
    """cdef text for cffi plus {function: {"ret": type, "params": [[type, name], ...]}}."""
    text = _preprocess(include_dir, workdir)
    # cffi cannot declare a static variable; variadic _mlx_error is not ours to call.
    text = re.sub(r"static\s+mlx_array\s+mlx_array_empty\s*;", "", text)
    text = re.sub(r"void\s+_mlx_error\s*\([^;]*\);", "", text)
    header = "typedef uint16_t float16_t;\ntypedef uint16_t bfloat16_t;\n"
    cdef = FAKE_LIBC["stdint.h"] + "\n" + FAKE_LIBC["stddef.h"] + "\n" + FAKE_LIBC["stdio.h"] + "\n" + header + text
    cdef = "\n".join(line for line in cdef.splitlines() if line.strip())
    return cdef, _signatures(cdef)


def _signatures(cdef: str) -> dict:
    from pycparser import c_ast, c_generator, c_parser

    # pycparser knows no _Bool / _Complex spelling issues if we name them plainly.
    source = "typedef int bool;\n" + cdef.replace("float _Complex", "float")
    ast = c_parser.CParser().parse(source)
    gen = c_generator.CGenerator()
    out: dict[str, dict] = {}
    for node in ast.ext:
        if isinstance(node, c_ast.Decl) and isinstance(node.type, c_ast.FuncDecl):
            params = []
            for i, p in enumerate(node.type.args.params if node.type.args else []):
                if isinstance(p, c_ast.Typename) and gen.visit(p.type) == "void":
                    continue
                name = getattr(p, "name", None) or f"arg{i}"
                ptype = gen.visit(p.type) if not isinstance(p, c_ast.EllipsisParam) else "..."
                params.append([ptype.replace(f" {name}", "").strip(), name])
            out[node.name] = {"ret": gen.visit(node.type.type).strip(), "params": params}
    return out


def mark_nullable(signatures: dict, header_dir: Path) -> None:
    """Record the parameters that mlx-c documents as `/* may be null */` (all others must be set)."""
    for header in header_dir.glob("*.h"):
        for match in re.finditer(r"\b(mlx_\w+)\s*\(([^;]*?)\);", header.read_text(), re.S):
            name, params = match.groups()
            if name in signatures and "may be null" in params:
                signatures[name]["nullable"] = re.findall(r"(\w+)\s*/\*\s*may be null", params)


# ----------------------------------------------------------------------------- driver

def read_stamp(output: Path = DEFAULT_OUTPUT) -> dict | None:
    path = output / STAMP_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def is_current(output: Path, pin: dict, mlx_version: str) -> bool:
    stamp = read_stamp(output)
    return bool(
        stamp
        and stamp.get("mlx_version") == mlx_version
        and stamp.get("mlx_c_commit") == pin["commit"]
        and all((output / f).exists() for f in ("cdef.h", "signatures.json", stamp["library"]))
    )


def build(source: Path | None = None, force: bool = False, output: Path = DEFAULT_OUTPUT) -> Path:
    pin = load_pin()
    mlx_prefix, mlx_version = find_mlx()
    if PYPROJECT.is_file():  # a source tree or an sdist (an installed copy of this file has no pins)
        check_mlx_version(mlx_version, pinned_mlx_version(), mlx_prefix)
    output.mkdir(parents=True, exist_ok=True)
    if not force and source is None and is_current(output, pin, mlx_version):
        print(f"[build_mlxc] {output} is current (MLX {mlx_version}, mlx-c {pin['commit'][:10]})", file=sys.stderr)
        return output
    with tempfile.TemporaryDirectory(prefix="pymlxc-build-") as tmp:
        workdir = Path(tmp)
        tree, origin = obtain_source(pin, source, workdir)
        print(f"[build_mlxc] mlx-c {pin['commit'][:10]} from {origin}", file=sys.stderr)
        edits = apply_compat_edits(tree, mlx_version)
        library = build_library(tree, mlx_prefix, workdir, output)
        cdef, signatures = generate_cdef(output / "include", workdir)
        mark_nullable(signatures, output / "include" / "mlx" / "c")
    (output / "cdef.h").write_text(cdef + "\n")
    (output / "signatures.json").write_text(json.dumps(signatures, indent=0, sort_keys=True))
    stamp = {
        "mlx_version": mlx_version,
        "mlx_prefix": str(mlx_prefix),
        "mlx_c_commit": pin["commit"],
        "library": library.name,
        "compat_edits": edits,
        "source": origin,
    }
    (output / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
    print(f"[build_mlxc] built {library} for MLX {mlx_version}", file=sys.stderr)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help="mlx-c source: a directory, a tarball, or a git directory")
    parser.add_argument("--force", action="store_true", help="rebuild even when the stamp is current")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where libmlxc and the cdef go")
    args = parser.parse_args(argv)
    try:
        build(args.source, args.force, args.output)
    except BuildError as exc:
        print(f"build_mlxc: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
