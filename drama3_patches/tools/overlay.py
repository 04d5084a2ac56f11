"""``drama3-patches overlay DIR``: a folder to mount into an image nobody may rebuild.

Python runs no ``.pth`` file from a ``PYTHONPATH`` folder, so mounting the package there would
not activate it. The folder written here holds the package (with its manifest), the dependencies
the image's Python lacks (by version: those missing or outside the package's declared ranges,
found by asking that Python with ``--python``; without it all of them, for this Python), and a
``sitecustomize.py`` that activates as the ``.pth`` line does and then runs the image's own
``sitecustomize``, if it has one. ``drama3-overlay.json`` says what was written.

The folder is built in a private temporary folder beside DIR and renamed into place, so a
reader never sees half of it; DIR must not exist, or be an empty folder of this user that
nobody else can write.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile

DIST = "drama3-patches"
RECORD = "drama3-overlay.json"
PROBE_TIMEOUT_S = 60
PIP_TIMEOUT_S = 600

# Run by the image's Python: what it has of the given distributions, and its own sitecustomize.
# Its first line drops the working folder from sys.path before anything is imported from it (a
# planted json.py there must not run as root; -P is 3.11+, and -I would hide the image's view).
PROBE = """import sys
del sys.path[0]
import importlib.metadata as m, importlib.machinery as mach, json, platform
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
spec = mach.PathFinder.find_spec("sitecustomize")
print(json.dumps({"python": platform.python_version(), "executable": sys.executable,
                  "versions": {n: version(n) for n in sys.argv[1:]},
                  "sitecustomize": spec.origin if spec else None}))
"""

SITECUSTOMIZE = '''"""Written by `drama3-patches overlay`: Python imports this at start-up from PYTHONPATH.

It activates drama3-patches as the package's .pth line does (DRAMA3_PATCHES off: nothing of ours is
imported), then runs the image's own sitecustomize, if it has one, as if this file were not there.
"""

import os
import sys


def _image_sitecustomize():
    import importlib.machinery
    import importlib.util

    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # the image's module is the one others see
    spec.loader.exec_module(module)


try:
    if os.environ.get("DRAMA3_PATCHES", "").strip().lower() not in ("", "0", "false", "no", "off"):
        __import__("drama3_patches._bootstrap", fromlist=["activate"]).activate("sitecustomize")
finally:
    _image_sitecustomize()
'''


def register(sub) -> None:
    p = sub.add_parser("overlay", help="write a folder to mount on PYTHONPATH: the package, the dependencies the "
                                       "image lacks and a sitecustomize that activates it")
    p.add_argument("dir", metavar="DIR", help="the folder to write (absent, or an empty folder of yours)")
    p.add_argument("--python", metavar="PYTHON",
                   help="the image's Python (an executable here): only the dependencies it lacks are written, "
                        "for its version and platform, and its own sitecustomize is found (default: all of "
                        "them, for this Python)")
    p.set_defaults(func=run)


def requirements() -> list:
    """This package's declared run-time requirements (no extras), as ``Requirement`` objects."""
    import importlib.metadata

    from packaging.requirements import Requirement

    from drama3_patches.tools.files import InputError

    try:
        declared = importlib.metadata.requires(DIST) or []
    except importlib.metadata.PackageNotFoundError:
        raise InputError(f"{DIST} is not installed in this Python ({sys.executable}): the overlay takes its "
                         "dependencies from the installed package's metadata; run `pip install .` first") from None
    out = []
    for text in declared:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            req.marker = None
            out.append(req)
    return out


def probe(python: str, names: list[str]) -> dict:
    """Ask ``python`` (without this shell's PYTHONPATH or our variables) what it has."""
    from drama3_patches.tools.files import InputError

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("DRAMA3_PATCHES")}
    try:
        proc = subprocess.run([python, "-c", PROBE, *names], capture_output=True, text=True, env=env,
                              timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InputError(f"--python {python}: cannot run it ({exc}); give an executable Python") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise InputError(f"--python {python}: exited {proc.returncode} ({last}); give a Python 3.8 or later")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def missing(reqs: list, versions: dict) -> list:
    """The requirements the probed Python does not meet (absent, or a version outside the range)."""
    from packaging.version import InvalidVersion, Version

    out = []
    for req in reqs:
        have = versions.get(req.name)
        try:
            ok = have is not None and req.specifier.contains(Version(have), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            out.append(req)
    return out


def check_target(path: str) -> None:
    """DIR is absent, or an empty real folder of this user that nobody else can write."""
    from drama3_patches.tools.files import InputError

    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise InputError(f"{path}: its parent folder {parent} does not exist; create it first")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise InputError(f"{path} exists and is not a folder (or is a link): give a new folder")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise InputError(f"{path} is another user's or others can write it: give a new folder, or a folder of "
                         "yours closed to others (chmod go-w)")
    if os.listdir(path):
        raise InputError(f"{path} is not empty: give a new folder (an overlay is written whole, never merged)")


def _package_source() -> tuple[str, str]:
    """The installed package's folder and the manifest it ships (packaged, else the source tree's)."""
    import drama3_patches

    package = os.path.dirname(os.path.abspath(drama3_patches.__file__))
    for manifest in (os.path.join(package, "patches_manifest.yaml"),
                     os.path.join(os.path.dirname(package), "patches_manifest.yaml")):
        if os.path.isfile(manifest):
            return package, manifest
    raise FileNotFoundError(f"no patches_manifest.yaml beside {package}")


def _pip(python: str, target: str, reqs: list) -> None:
    from drama3_patches.tools.files import InputError

    from drama3_patches.tools import isolated_python

    proc = isolated_python.run("-m", "pip", "--python", python, "install", "--quiet", "--disable-pip-version-check",
                               "--no-deps", "--no-compile", "--target", target, *map(str, reqs),
                               timeout=PIP_TIMEOUT_S, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise InputError(f"pip could not fetch {', '.join(map(str, reqs))} for {python} ({last}); offline, "
                         "set PIP_NO_INDEX=1 and PIP_FIND_LINKS=a folder of their wheels (README, "
                         "\"Install without an index\")")


def _open_up(root: str) -> None:
    """Readable by the container's user, writable by nobody but this one."""
    for folder, dirs, files in os.walk(root):
        os.chmod(folder, 0o755)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o644)


def size_bytes(root: str) -> int:
    return sum(os.lstat(os.path.join(folder, n)).st_size for folder, _, files in os.walk(root) for n in files)


def write(path: str, python: str | None) -> dict:
    """Write the overlay at ``path``; what was written (also in DIR/drama3-overlay.json)."""
    from drama3_patches import __version__
    from drama3_patches.tools.files import InputError

    check_target(path)
    reqs = requirements()
    image = probe(python or sys.executable, [r.name for r in reqs])
    needed = missing(reqs, image["versions"]) if python else reqs
    package, manifest = _package_source()
    build = tempfile.mkdtemp(prefix=".drama3-overlay-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        shutil.copytree(package, os.path.join(build, "drama3_patches"),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        shutil.copyfile(manifest, os.path.join(build, "drama3_patches", "patches_manifest.yaml"))
        if needed:
            _pip(image["executable"], build, needed)
        with open(os.path.join(build, "sitecustomize.py"), "w") as fh:
            fh.write(SITECUSTOMIZE)
        record = {"drama3_patches": __version__, "python": image["python"], "for_python": image["executable"],
                  "probed": bool(python), "dependencies_written": [str(r) for r in needed],
                  "image_has": image["versions"] if python else None,
                  "image_sitecustomize": image["sitecustomize"] if python else None}
        with open(os.path.join(build, RECORD), "w") as fh:
            json.dump(record, fh, indent=1)
        _open_up(build)
        try:
            os.rename(build, path)  # onto an absent or empty folder: whole or not at all
        except OSError as exc:  # DIR appeared (or filled) since it was checked
            raise InputError(f"{path}: cannot put the overlay there ({exc.strerror}): give a new folder") from None
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return {**record, "dir": os.path.abspath(path), "size_bytes": size_bytes(path)}


def run(args) -> int:
    from drama3_patches.tools.report import format_bytes

    done = write(args.dir, args.python)
    deps = ", ".join(done["dependencies_written"]) or "none (the image has them all)"
    print(f"drama3-patches overlay: wrote {done['dir']} ({format_bytes(done['size_bytes'], 0).strip()}) for Python "
          f"{done['python']}: the package, its manifest, sitecustomize.py; dependencies: {deps}")
    if done["image_sitecustomize"]:
        print(f"the image's own sitecustomize ({done['image_sitecustomize']}) still runs, after ours")
    if not done["probed"]:
        print("without --python every dependency was written, for this Python: give the image's Python to "
              "write only what it lacks, for its version")
    print(f"mount it: -v {done['dir']}:/opt/drama3 -e PYTHONPATH=/opt/drama3 -e DRAMA3_PATCHES=1")
    return 0
