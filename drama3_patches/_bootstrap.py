"""Start-up hook: what the ``drama3_patches.pth`` line imports.

It runs in every interpreter of a deployment with ``DRAMA3_PATCHES`` on, so on its common path
it imports nothing but itself (and the package ``__init__``, which only defines names): no yaml,
wrapt, torch or vllm, and not even ``env`` or ``reader``. It finds the target modules, puts an
import trigger at the front of ``sys.meta_path`` and returns; the engine is imported only when a
target module is first imported.

The target modules come from a small cache file (:data:`CACHE_NAME`) in the private cache folder
(``DRAMA3_PATCHES_CACHE_DIR``, else ``$XDG_CACHE_HOME/drama3_patches`` or
``~/.cache/drama3_patches``), one entry per manifest, keyed by the manifest's path and its
identity on disk (device, inode, size, mtime and ctime in nanoseconds): an edit, a copy over it
or a new file at that path changes the key, and the manifest is then line-scanned again and the
entry rewritten. So start-up costs the same whatever the manifest's size, and a new manifest
entry is picked up at the first start after it is written. The cache is used only when nobody
else could have written it (the folder and the file belong to this user, are closed to group and
others, and neither is reached through a symbolic link); on any doubt or error the manifest is
scanned, silently, as without a cache.

A stale list cannot patch anything the manifest does not name: a trigger only calls the engine,
which reads the manifest itself and then triggers every module that manifest names
(``Engine.on_import``).
"""

import os
import stat
import sys

# What the trigger calls once a target module has executed: a string, so the engine
# (yaml, packaging, the manifest) is imported only then.
HOOK = "drama3_patches.engine:on_import"
ACTIVATE = "drama3_patches.engine:activate"

# Copies of names of drama3_patches.env, which this module imports only off its common path
# (tests/engine/test_startup_cache.py checks that they agree).
_ENABLE = "DRAMA3_PATCHES"
_TRUE = ("1", "true", "yes", "on")
_MANIFEST = "DRAMA3_PATCHES_MANIFEST"
_CACHE_DIR = "DRAMA3_PATCHES_CACHE_DIR"

CACHE_NAME = "startup-targets"
# The cache file's first line; the number changes whenever the scan or the format does.
CACHE_HEADER = "drama3-patches start-up targets 1"
CACHE_MAX_BYTES = 64 << 10
CACHE_ENTRIES = 16
# A manifest changed less than this ago is not cached: a second write within the file system's
# timestamp granularity could leave size and times (the key) as they were, with other contents.
RACY_NS = 1_000_000_000
_O_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

# Where this process's start-up list came from: "cache", "manifest" (scanned), None (not activated).
targets_from = None
# What activated this process first: ".pth" (the line in site-packages), "sitecustomize" (the
# overlay's, `drama3-patches overlay`), "plugin" (vLLM's general_plugins entry point), "api" (the
# package API or the engine called directly); None before any. status() shows it.
ROUTES = (".pth", "sitecustomize", "plugin", "api")
activated_by = None


def note_activation(route: str) -> None:
    """Record ``route`` as how this process was activated, unless another route came first."""
    global activated_by
    if activated_by is None:
        activated_by = route


def _call(hook: str, *args) -> None:
    """Run the engine; its errors never fail the host's import unless DRAMA3_PATCHES_STRICT=1."""
    try:
        import pkgutil

        pkgutil.resolve_name(hook)(*args)
    except Exception as exc:  # a broken manifest, a missing dependency, an engine bug
        from drama3_patches import env

        env.soft_failure("drama3-patches could not patch", exc)


def scan_target_modules(text: str) -> list[str]:
    """Module names of every ``targets:`` entry, without a YAML parser.

    Only the block form the manifest uses is read (``targets:`` then one
    ``- module:Qualified.name`` per line); a test checks that this scan and the
    YAML loader agree on the shipped manifest.
    """
    modules: dict[str, None] = {}  # ordered and linear: a list lookup made 20,000 targets cost seconds
    in_targets = False
    indent = 0
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        lead = len(line) - len(line.lstrip())
        if in_targets:
            if stripped.startswith("- ") and lead >= indent:
                item = stripped[2:].split("#", 1)[0].strip().strip("'\"")
                module = item.split(":", 1)[0].strip()
                if module:
                    modules.setdefault(module)
                continue
            in_targets = False
        key = stripped[2:] if stripped.startswith("- ") else stripped
        if key.split("#", 1)[0].strip() == "targets:":
            in_targets = True
            indent = lead
    return list(modules)


def _fire(module_name: str) -> None:
    _call(HOOK, module_name)


class _ExecThenPatch:
    """Loader proxy for loaders we must not modify in place (shared ones)."""

    def __init__(self, loader, module_name: str):
        self._loader = loader
        self._module_name = module_name

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        self._loader.exec_module(module)
        _fire(self._module_name)


class TriggerFinder:
    """Meta-path finder that runs the engine right after a target module executes.

    It finds nothing itself: it asks the finders behind it and wraps the
    loader's ``exec_module`` so that patches land after the module body ran and
    before the importer binds names from it (``from x import f`` sees the patch).
    """

    def __init__(self, modules):
        self.modules = set(modules)

    def add(self, modules) -> None:
        self.modules.update(modules)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        spec = None
        for finder in list(sys.meta_path):
            if finder is self or isinstance(finder, TriggerFinder):
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        from importlib.machinery import ExtensionFileLoader, SourceFileLoader, SourcelessFileLoader

        loader = spec.loader
        if isinstance(loader, (SourceFileLoader, SourcelessFileLoader, ExtensionFileLoader)):
            # One loader instance per file: an instance attribute is enough and
            # keeps module.__loader__ the real loader.
            original = loader.exec_module

            def exec_module(module, _original=original, _name=fullname):
                _original(module)
                _fire(_name)

            loader.exec_module = exec_module
        else:
            spec.loader = _ExecThenPatch(loader, fullname)
        return spec


def installed_finder() -> TriggerFinder | None:
    for finder in sys.meta_path:
        if isinstance(finder, TriggerFinder):
            return finder
    return None


def install_trigger(modules) -> TriggerFinder:
    finder = installed_finder()
    if finder is None:
        finder = TriggerFinder(modules)
        sys.meta_path.insert(0, finder)
    else:
        finder.add(modules)
    return finder


def manifest_path() -> str:
    """The manifest in force: $DRAMA3_PATCHES_MANIFEST, the packaged copy, or the source tree's.
    The one place that says so (the manifest loader asks here): it needs no import of env."""
    override = os.environ.get(_MANIFEST)
    if override:
        return override
    here = os.path.dirname(os.path.abspath(__file__))
    packaged = os.path.join(here, "patches_manifest.yaml")
    if os.path.exists(packaged):
        return packaged
    return os.path.join(os.path.dirname(here), "patches_manifest.yaml")


def cache_dir() -> str | None:
    """The private cache folder (the native fp8 kernel's too), None without one to name."""
    explicit = os.environ.get(_CACHE_DIR)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.environ.get("HOME")  # not expanduser: without HOME it would read the password database
        if not home:
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "drama3_patches")


_NOT_PRIVATE = "the start-up cache is not private to this user"


def check_private(st: os.stat_result, error=PermissionError, foreign=None, writable=None) -> None:
    """Raise ``error`` when ``st`` is not this user's, or group or others may write it.

    ``foreign(uid)`` and ``writable(mode)`` word the message, so each caller keeps the words and the
    exception class its operators know (the start-up cache's one line, the report folder's, the
    kernel cache's ``UnsafeCache``)."""
    if st.st_uid != os.geteuid():
        raise error(foreign(st.st_uid) if foreign else _NOT_PRIVATE)
    if st.st_mode & 0o022:
        raise error(writable(st.st_mode & 0o7777) if writable else _NOT_PRIVATE)


def _make_private(folder: str) -> None:
    """Create ``folder`` and every missing parent, each 0700 (``os.makedirs`` would give the
    parents the umask's mode, 0755 as a rule)."""
    missing = []
    path = folder
    while True:
        try:
            os.mkdir(path, 0o700)
            break
        except FileExistsError:
            break
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if not parent or parent == path:
                raise
            missing.append(path)
            path = parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass


def open_private_dir(folder, create: bool = False, error=PermissionError, foreign=None, writable=None,
                     link=None) -> int:
    """A descriptor of ``folder`` (created 0700 with 0700 parents when ``create``), checked private.

    The one opener of the package's private folders (the start-up cache, the kernel cache, the
    report folder): the last component is never followed (``O_NOFOLLOW``; a link there raises
    ``error`` with ``link()``'s words), and the checks are made on the open descriptor, so work
    done through it is unaffected by whoever renames the path afterwards. ``error``, ``foreign``
    and ``writable`` as for :func:`check_private`."""
    folder = os.fspath(folder)
    if create:
        _make_private(os.path.normpath(folder))
    try:
        fd = os.open(folder, _O_READ | os.O_DIRECTORY)
    except OSError as exc:
        if os.path.islink(folder):  # O_NOFOLLOW|O_DIRECTORY on a link: ENOTDIR or ELOOP
            raise error(link() if link else _NOT_PRIVATE) from None
        raise exc from None
    try:
        check_private(os.fstat(fd), error, foreign, writable)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_entries(dir_fd: int) -> list[str]:
    """The cache file's entries (``path TAB key TAB modules``); [] when absent or of another format."""
    try:
        fd = os.open(CACHE_NAME, _O_READ | getattr(os, "O_NONBLOCK", 0), dir_fd=dir_fd)
    except FileNotFoundError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > CACHE_MAX_BYTES:
            raise PermissionError("the start-up cache is not a small regular file")
        check_private(st)
        chunks, left = [], CACHE_MAX_BYTES + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > CACHE_MAX_BYTES:
        raise PermissionError("the start-up cache grew while read")
    lines = data.decode("utf-8").split("\n")
    # Written whole and renamed into place, so the last line is empty: anything else is not ours.
    if lines[0] != CACHE_HEADER or lines[-1] != "":
        return []
    return [line for line in lines[1:] if line]


def _key(st: os.stat_result) -> str:
    return f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


def replace_file(dir_fd: int, name: str, data: bytes) -> None:
    """Put ``data`` at ``name`` in the folder ``dir_fd``, whole or not at all: written to a new
    file of random name (created exclusively, never through a link, mode 0600), then renamed over
    ``name``. A name already taken (planted or left over) is never reused; the temporary file
    goes on any failure. The status reports are written this way too (``engine.state``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(16):
        tmp = f".{os.getpid()}.{os.urandom(8).hex()}.tmp"
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError("no free temporary name in the folder")
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def _trusted_manifest(st: os.stat_result) -> bool:
    """Owned by root or this user, not writable by group or others: what ``reader.read_manifest``
    requires, checked here on the cache's path stat without importing the reader."""
    return st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022


def _from_cache(path: str) -> list[str] | None:
    """The target modules cached for the manifest at ``path`` as it is now; None when there is no
    such entry, or on any doubt (then the caller scans)."""
    try:
        folder = cache_dir()
        if folder is None:
            return None
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or not _trusted_manifest(st):
            return None  # the scan then refuses it, with the warning
        dir_fd = open_private_dir(folder, create=False)
        try:
            entries = _read_entries(dir_fd)
        finally:
            os.close(dir_fd)
        prefix = f"{path}\t{_key(st)}\t"
        for line in entries:
            if line.startswith(prefix):
                return line[len(prefix):].split()
    except Exception:  # absent, refused or unreadable: scan instead
        return None
    return None


def _store(path: str, st: os.stat_result, modules: list[str]) -> None:
    """Put this manifest's entry first in the cache file (written aside, then renamed); never raises."""
    try:
        import time

        folder = cache_dir()
        if folder is None or "\t" in path or "\n" in path:
            return
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_NS:
            return
        dir_fd = open_private_dir(folder, create=True)
        try:
            try:
                entries = _read_entries(dir_fd)
            except (OSError, ValueError):  # refused or garbled: ours replaces it
                entries = []
            entries = [f"{path}\t{_key(st)}\t{' '.join(modules)}"] + [
                e for e in entries if not e.startswith(f"{path}\t")][:CACHE_ENTRIES - 1]
            data = "\n".join([CACHE_HEADER, *entries, ""]).encode()
            if len(data) > CACHE_MAX_BYTES:
                return
            replace_file(dir_fd, CACHE_NAME, data)
        finally:
            os.close(dir_fd)
    except Exception:  # a read-only home, a full disk, a folder not ours: the next start scans again
        pass


def _from_manifest(path: str) -> list[str] | None:
    """Line-scan the manifest (and cache what it names); None, with one warning, when unreadable or
    refused (``reader.read_manifest``: another owner, writable by others, over 1 MiB); raised under
    DRAMA3_PATCHES_STRICT=1."""
    from drama3_patches import reader

    try:
        data, st = reader.read_manifest(path)
        text = reader.decode_text(data, path, "manifest")
    except OSError as exc:
        from drama3_patches import env

        if env.strict():
            raise
        # soft_failure's key: the engine, called later by vLLM's plugin hook, refuses the same
        # manifest, and the process hears of it once
        env.warn_once("soft-failure", f"cannot read the patch manifest ({exc}); no patch will apply "
                      f"(point {env.MANIFEST} at a readable manifest file, or unset it)")
        return None
    modules = scan_target_modules(text)
    _store(path, st, modules)
    return modules


def activate(route: str = ".pth") -> None:
    """Called by the ``.pth`` line (and the overlay's ``sitecustomize``, naming its ``route``):
    register triggers; patch what is already imported."""
    global targets_from
    if targets_from is not None:  # once per process (some virtual environments run .pth files twice)
        return
    if os.environ.get(_ENABLE, "").strip().lower() not in _TRUE:
        from drama3_patches import env

        if not env.enabled():  # off, or a value it does not understand (warned once)
            return
    path = manifest_path()
    modules = _from_cache(path)
    if modules is not None:
        targets_from = "cache"
    else:
        modules = _from_manifest(path)
        if modules is None:
            return
        targets_from = "manifest"
    note_activation(route)
    install_trigger(modules)
    # Late start: a target imported before us (rare at .pth time) is patched now.
    if any(m in sys.modules for m in modules):
        _call(ACTIVATE)
