"""Start-up hook: what the ``drama3_patches.pth`` line imports.

Standard library only (no torch, yaml, wrapt, packaging or vllm): this runs in
every interpreter of the deployment, so it reads the environment, finds the
target modules with a line scan of the manifest, puts an import trigger at the
front of ``sys.meta_path`` and returns.  The engine itself is imported only
when a target module is first imported.
"""

import sys

from drama3_patches import env, reader

# What the trigger calls once a target module has executed: a string, so the engine
# (yaml, packaging, the manifest) is imported only then.
HOOK = "drama3_patches.engine:on_import"
ACTIVATE = "drama3_patches.engine:activate"


def _call(hook: str, *args) -> None:
    """Run the engine; its errors never fail the host's import unless DRAMA3_PATCHES_STRICT=1."""
    try:
        import pkgutil

        pkgutil.resolve_name(hook)(*args)
    except Exception as exc:  # a broken manifest, a missing dependency, an engine bug
        env.soft_failure("drama3-patches could not patch", exc)


def scan_target_modules(text: str) -> list[str]:
    """Module names of every ``targets:`` entry, without a YAML parser.

    Only the block form the manifest uses is read (``targets:`` then one
    ``- module:Qualified.name`` per line); a test checks that this scan and the
    YAML loader agree on the shipped manifest.
    """
    modules: list[str] = []
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
                if module and module not in modules:
                    modules.append(module)
                continue
            in_targets = False
        key = stripped[2:] if stripped.startswith("- ") else stripped
        if key.split("#", 1)[0].strip() == "targets:":
            in_targets = True
            indent = lead
    return modules


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


def activate() -> None:
    """Called by the ``.pth`` line: register triggers; patch what is already imported."""
    if not env.enabled():
        return
    try:
        modules = scan_target_modules(reader.read_manifest_text(env.manifest_path()))
    except OSError as exc:
        env.warn_once("manifest", f"cannot read the patch manifest ({exc}); no patch will apply "
                      f"(point {env.MANIFEST} at a readable manifest file, or unset it)")
        return
    install_trigger(modules)
    # Late start: a target imported before us (rare at .pth time) is patched now.
    if any(m in sys.modules for m in modules):
        _call(ACTIVATE)
