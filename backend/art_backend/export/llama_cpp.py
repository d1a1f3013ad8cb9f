"""llama.cpp from the sources that llama-cpp-python's sdist vendors: its GGUF converter
(`convert_hf_to_gguf.py`, run as it is) and its tools (`llama-server`, `llama-quantize`), built once.

The sdist is fetched with pip (`pip download`, so whatever index pip is set up for) and its
`vendor/llama.cpp` tree is unpacked once under `<cache_dir>/llama.cpp/<version>/source` (without its
docs, media and test vocabularies). What the converter accepts, the architectures it converts and the
types it writes, is read from those sources rather than listed here, so a newer llama.cpp brings its own.
Tools are built with cmake and a C++ compiler (CPU, static; a few minutes on 2 cores) into
`<cache_dir>/llama.cpp/<version>/`.
"""

from __future__ import annotations

import ast
import collections
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from art_backend.model_store import publish_directory
from art_integrations.wire import free_loopback_port

logger = logging.getLogger(__name__)

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is used
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # where ggml's AMX matmul crashes
CONVERTER = "convert_hf_to_gguf.py"
_LEFT_OUT = ("models/", "docs/", "media/")  # test vocabularies and pictures: 110 of the tree's 176 MB


class LlamaCppError(RuntimeError):
    """llama.cpp could not be fetched, built or run; the message says what to do."""


def home(cache_dir: Path) -> Path:
    return Path(cache_dir) / "llama.cpp" / LLAMA_CPP_PYTHON


def sources(cache_dir: Path) -> Path:
    """llama.cpp's source tree, fetched and unpacked on first use."""

    def fetch(out: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="llama-cpp-sdist-") as work:
            logger.info("Fetching llama.cpp's sources (llama-cpp-python %s's sdist, 77 MB), once", LLAMA_CPP_PYTHON)
            fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                                      ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", work],
                                     capture_output=True, text=True)
            if fetched.returncode != 0:
                raise LlamaCppError(
                    f"Fetching llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist (llama.cpp's sources) with pip failed: "
                    f"{fetched.stderr.strip()[-1500:]}. This machine needs pip and its package index; or fetch it "
                    f"elsewhere (`pip download --no-deps --no-binary :all: llama-cpp-python=={LLAMA_CPP_PYTHON}`) "
                    f"and unpack its vendor/llama.cpp as {home(cache_dir) / 'source'}.")
            prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
            with tarfile.open(next(Path(work).glob("llama_cpp_python-*.tar.gz"))) as sdist:
                members = []
                for member in sdist.getmembers():
                    if member.name.startswith(prefix) and not member.name[len(prefix):].startswith(_LEFT_OUT):
                        member.name = member.name[len(prefix):]
                        members.append(member)
                sdist.extractall(out, members=members, filter="data")

    return publish_directory(fetch, home(cache_dir) / "source", marker=CONVERTER)


# ----- what the converter and llama-quantize accept, read from the sources ----------------------------

def converter_architectures(source: Path) -> set[str]:
    """The transformers architectures (config.json's `architectures`) the converter has a class for:
    the names its `@ModelBase.register(...)` decorators list."""
    names: set[str] = set()
    for path in [source / CONVERTER, *sorted((source / "conversion").glob("*.py"))]:
        for arguments in re.findall(r"@ModelBase\.register\(([^)]*)\)", path.read_text()):
            names.update(re.findall(r"[\"']([A-Za-z0-9_.]+)[\"']", arguments))
    if not names:
        raise LlamaCppError(f"Found no architecture registered in {source}'s converter: its layout changed; "
                            f"use llama-cpp-python {LLAMA_CPP_PYTHON}'s sources.")
    return names


def converter_types(source: Path) -> list[str]:
    """The types `convert_hf_to_gguf.py --outtype` writes (lower case, as it takes them), `auto` left out."""
    for node in ast.walk(ast.parse((source / CONVERTER).read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
                and any(isinstance(a, ast.Constant) and a.value == "--outtype" for a in node.args)):
            for keyword in node.keywords:
                if keyword.arg == "choices":
                    return [t for t in ast.literal_eval(keyword.value) if t != "auto"]
    raise LlamaCppError(f"{source / CONVERTER} has no --outtype choices: its layout changed.")


def quantize_types(source: Path) -> list[str]:
    """The types llama-quantize makes (its QUANT_OPTIONS), lower case."""
    text = (source / "tools" / "quantize" / "quantize.cpp").read_text()
    table = text[text.index("QUANT_OPTIONS"):]
    table = table[:table.index("};")]
    return [name.lower() for name in re.findall(r'\{\s*"([A-Z0-9_]+)"\s*,\s*LLAMA_FTYPE_', table) if name != "COPY"]


# ----- running them ------------------------------------------------------------------------------------

def convert(source: Path, model_dir: Path, outfile: Path, outtype: str) -> None:
    """Run llama.cpp's converter on a transformers model directory, in a child Python (this one's
    interpreter, with the sources' own gguf-py first), its log shown only when it fails."""
    command = [sys.executable, str(source / CONVERTER), str(model_dir), "--outfile", str(outfile), "--outtype", outtype]
    ran = subprocess.run(command, capture_output=True, text=True)
    if ran.returncode != 0:
        raise LlamaCppError(f"llama.cpp's converter failed (exit {ran.returncode}) on {model_dir}:\n"
                            f"{ran.stderr.strip()[-3000:]}")


def quantize(binary: Path, infile: Path, outfile: Path, kind: str, threads: int | None = None) -> None:
    ran = subprocess.run([str(binary), str(infile), str(outfile), kind.upper(), str(threads or os.cpu_count() or 1)],
                         capture_output=True, text=True)
    if ran.returncode != 0:
        raise LlamaCppError(f"llama-quantize refused {kind.upper()} (exit {ran.returncode}):\n"
                            f"{(ran.stderr or ran.stdout).strip()[-2000:]}")


def tool_path(cache_dir: Path, name: str, amx: bool = True) -> Path:
    """Where a llama.cpp tool built here lives (it may not be built yet)."""
    return home(cache_dir) / (name if amx else f"{name}-no-amx")


def build_tools(cache_dir: Path, names: Iterable[str], amx: bool = True) -> dict[str, Path]:
    """llama.cpp's tools (`llama-server`, `llama-quantize`), built once (static, CPU) into the cache;
    with `amx=False` without ggml's AMX matmul (their own builds, cached apart)."""
    names = list(names)
    binaries = {name: tool_path(cache_dir, name, amx) for name in names}
    missing = [name for name, path in binaries.items() if not path.is_file()]
    if not missing:
        return binaries
    for program in ("cmake", "c++"):
        if shutil.which(program) is None:
            raise LlamaCppError(f"Building llama.cpp's {', '.join(missing)} needs {program}: install it (e.g. "
                                "`apt-get install cmake g++`), or build llama.cpp yourself and pass its binaries.")
    source = sources(cache_dir)
    with tempfile.TemporaryDirectory(prefix="llama-cpp-build-") as build:
        logger.info("Building llama.cpp's %s from llama-cpp-python %s's sources, once (a few minutes)",
                    ", ".join(missing), LLAMA_CPP_PYTHON)
        configure = ["cmake", "-S", str(source), "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                     "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
                     "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF",
                     # offline: no web UI fetched, no HTTPS
                     "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF",
                     # explicit -mno-* flags win over the -march=native that ggml adds
                     *([] if amx else [f"-DCMAKE_{lang}_FLAGS={NO_AMX}" for lang in ("C", "CXX")])]
        for command in (configure, ["cmake", "--build", build, "--target", *missing, "-j", str(os.cpu_count() or 1)]):
            _run_showing_progress(command)
        for name in missing:
            binaries[name].parent.mkdir(parents=True, exist_ok=True)
            staged = binaries[name].with_name(f".{binaries[name].name}.partial")
            shutil.copy2(Path(build) / "bin" / name, staged)
            os.replace(staged, binaries[name])
            logger.info("Built %s", binaries[name])
    return binaries


def _run_showing_progress(command: list[str]) -> None:
    """Run a cmake step; the build's own "[ 42%]" lines become a log line per tenth done, and its
    output's tail goes into the error if it fails."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    tail: collections.deque[str] = collections.deque(maxlen=60)
    shown = -1
    for line in process.stdout:
        tail.append(line)
        done = re.match(r"\[\s*(\d+)%\]", line)
        if done and int(done.group(1)) // 10 > shown:
            shown = int(done.group(1)) // 10
            logger.info("llama.cpp build: %s%%", done.group(1))
    if process.wait() != 0:
        raise LlamaCppError(f"Building llama.cpp failed ({' '.join(command[:3])} ..., exit {process.returncode}):\n"
                            f"{''.join(tail).strip()[-3000:]}")


def start_server(binary: Path, gguf: Path, threads: int, slots: int, log: Path,
                 extra: Iterable[str] = ()) -> tuple[subprocess.Popen[bytes], str]:
    """llama-server on a free loopback port serving `gguf`, once its /health answers: (process, base URL)."""
    port = free_loopback_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
               "--threads-batch", str(threads), "--parallel", str(slots), "--ctx-size", str(slots * 512), *extra]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LlamaCppError(f"llama-server exited with {process.returncode}; its log: {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.5)
    process.kill()
    process.wait()
    raise LlamaCppError(f"llama-server did not answer /health within 120 s; its log: {log}")


def main() -> None:
    """`make llama-cpp`: the tools the export and its tests use, built once. (Called, not run with
    `python -m`: the package's `__init__` imports this module first, and runpy would warn so.)"""
    from art_backend.config import BackendSettings

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name, path in build_tools(BackendSettings().cache_dir, ["llama-server", "llama-quantize"]).items():
        print(f"{name}: {path}")
