"""The patch engine: guards, apply/unapply, idempotence, the status registry.

It knows the manifest and the ``plan(ctx)`` protocol of ``patchlib``; it knows
nothing about any particular patch.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from drama3_patches import _bootstrap, env
from drama3_patches.logger import init_logger
from drama3_patches.manifest import Manifest, PatchSpec, Target, load_manifest
from drama3_patches.patchlib import NotNeeded, PatchContext

logger = init_logger(__name__)

PENDING, APPLIED, SKIPPED, NOT_NEEDED, FAILED = "pending", "applied", "skipped", "not-needed", "failed"
STATES = (PENDING, APPLIED, SKIPPED, NOT_NEEDED, FAILED)
MARKER = "__drama3_patch__"
# Reason prefix of a target that failed only because another target of its patch is missing.
ALONGSIDE = "not applied:"


class PatchError(RuntimeError):
    """Raised under DRAMA3_PATCHES_STRICT=1 when a needed patch fails to apply."""


class TargetAbsent(LookupError):
    pass


@dataclass
class TargetRecord:
    target: Target
    state: str = PENDING
    reason: str = "target module not imported yet"
    owner: Any = None
    attr: str = ""
    had_own: bool = True
    original: Any = None
    replacement: Any = None
    aliases: list = field(default_factory=list)  # [(module, name)] rebound to the replacement

    def as_dict(self) -> dict:
        return {
            "state": self.state,
            "reason": self.reason,
            "aliases": [f"{m}.{n}" for m, n in self.aliases],
        }


@dataclass
class PatchRecord:
    spec: PatchSpec
    state: str = PENDING
    reason: str = "no target module imported yet"
    removed: bool = False  # unapply() took it out; apply() puts it back
    lock: Any = field(default_factory=threading.RLock, repr=False)
    targets: dict = field(default_factory=dict)

    def __post_init__(self):
        self.targets = {t.spec: TargetRecord(t) for t in self.spec.targets}


def resolve(target: Target) -> tuple[Any, str, Any, bool]:
    """(owner, attribute, raw object, defined on owner itself) for a target."""
    module = sys.modules.get(target.module)
    if module is None:
        raise TargetAbsent(f"module {target.module} is not imported")
    owner: Any = module
    *path, attr = target.attr_path
    for name in path:
        try:
            owner = getattr(owner, name)
        except AttributeError:
            raise TargetAbsent(f"{target.module} has no attribute {'.'.join(path)!r}") from None
    own = getattr(owner, "__dict__", {})
    if attr in own:
        return owner, attr, own[attr], True
    try:
        # Inherited: the patch overrides it on this class; unapply deletes it again.
        return owner, attr, getattr(owner, attr), False
    except AttributeError:
        raise TargetAbsent(f"{target.spec} does not exist in the installed code") from None


class Engine:
    def __init__(self, manifest: Manifest | None = None):
        self._manifest = manifest
        self.forced = False
        self._records: dict[str, PatchRecord] | None = None
        self._ours: dict[int, tuple[str, Any]] = {}
        self._init_lock = threading.Lock()
        self._platform: str | None = None
        self._import_errors: dict[str, str] = {}  # module -> why `import_targets` could not import it

    # -- lazily built state ------------------------------------------------
    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            self._manifest = load_manifest()
        return self._manifest

    @property
    def records(self) -> dict[str, PatchRecord]:
        if self._records is None:
            with self._init_lock:
                if self._records is None:
                    self._records = {p.id: PatchRecord(p) for p in self.manifest.patches}
                    unknown = sorted(env.disabled_ids() - set(self._records))
                    if unknown:
                        env.warn_once(
                            "disable-unknown",
                            f"{env.DISABLE} names unknown patch id(s) {', '.join(unknown)}; "
                            f"known ids: {', '.join(self._records)}",
                        )
        return self._records

    @property
    def platform(self) -> str:
        if self._platform is None:
            from drama3_patches.platform import current_platform

            self._platform = current_platform()
        return self._platform

    def enabled(self) -> bool:
        return self.forced or env.enabled()

    # -- entry points --------------------------------------------------------
    def activate(self, ids: Iterable[str] | None = None, force: bool = False) -> None:
        """Install import triggers and patch every target already imported."""
        if force:
            self.forced = True
        selected = self._select(ids)
        for rec in selected:
            if force:
                rec.removed = False
        if self.enabled():
            _bootstrap.install_trigger(m for p in self.manifest.patches for m in p.modules)
        for rec in selected:
            self._evaluate(rec)

    def on_import(self, module_name: str) -> None:
        """Called by the import trigger after ``module_name`` executed (import or reload)."""
        for rec in self.records.values():
            if module_name not in rec.spec.modules:
                continue
            with rec.lock:
                for tr in rec.targets.values():
                    if tr.target.module == module_name and tr.state != APPLIED:
                        tr.state, tr.reason = PENDING, "target module re-executed"
            self._evaluate(rec)

    def unapply(self, ids: Iterable[str] | None = None) -> None:
        for rec in self._select(ids):
            with rec.lock:
                before = self._snapshot(rec)
                self._restore(rec, list(rec.targets.values()))
                rec.removed = True
                self._settle(rec)
                self._after_change(rec, before)

    def get_original(self, target_spec: str) -> Any:
        for rec in self.records.values():
            tr = rec.targets.get(target_spec)
            if tr is not None and tr.state == APPLIED:
                return tr.original
        raise KeyError(f"{target_spec} is not patched in this process")

    def is_ours(self, obj: Any) -> str | None:
        """The patch id that produced ``obj`` (or wraps it), else None."""
        seen = 0
        while obj is not None and seen < 16:
            hit = self._ours.get(id(obj))
            if hit is not None and hit[1] is obj:
                return hit[0]
            try:
                mark = obj.__dict__.get(MARKER) if hasattr(obj, "__dict__") else None
            except Exception:
                mark = None
            if isinstance(mark, str):
                return mark
            obj = getattr(obj, "__wrapped__", None) or getattr(obj, "__func__", None)
            seen += 1
        return None

    # -- the guard chain -------------------------------------------------------
    def _select(self, ids: Iterable[str] | None) -> list[PatchRecord]:
        if ids is None:
            return list(self.records.values())
        if isinstance(ids, str):
            ids = [ids]
        out = []
        for pid in ids:
            if pid not in self.records:
                raise KeyError(f"unknown patch id {pid!r}; known: {', '.join(self.records)}")
            out.append(self.records[pid])
        return out

    def _guard(self, rec: PatchRecord) -> str | None:
        """Reason to skip, in docs/design.md's order (enabled, disabled, platform, versions), else None."""
        spec = rec.spec
        if not self.enabled():
            return f"{env.ENABLE} is not enabled in this process"
        if rec.removed:
            return "removed by drama3_patches.unapply()"
        if spec.id in env.disabled_ids():
            return f"disabled by {env.DISABLE}"
        if self.platform not in spec.platforms:
            return f"platform {self.platform} not in {list(spec.platforms)}"
        from drama3_patches.versions import check

        for dist, specifier in spec.requires.items():
            ok, why = check(dist, specifier)
            if not ok:
                return why
        return None

    def _evaluate(self, rec: PatchRecord) -> None:
        with rec.lock:
            before = self._snapshot(rec)
            try:
                self._evaluate_locked(rec)
            finally:
                self._settle(rec)
                self._after_change(rec, before)

    def _evaluate_locked(self, rec: PatchRecord) -> None:
        skip = self._guard(rec)
        if skip is not None:
            for tr in rec.targets.values():
                if tr.state != APPLIED:
                    tr.state, tr.reason = SKIPPED, skip
            return
        # A reload puts a fresh original where our replacement was: patch it again.
        for tr in rec.targets.values():
            if tr.state == APPLIED and not self._still_bound(tr):
                tr.state, tr.reason = PENDING, "target replaced since (module reloaded)"
            elif tr.state == SKIPPED:
                tr.state, tr.reason = PENDING, "target module not imported yet"
        # Past the guards the patch's distributions are installed inside its version range, so a
        # target that is missing there is drift: the operator must hear about it (failed, not skipped).
        broken = {
            tr.target.spec: f"target module {tr.target.module} cannot be imported ({err})"
            for tr in rec.targets.values()
            if tr.state == PENDING and tr.target.module not in sys.modules
            and (err := self._import_errors.get(tr.target.module))
        }
        if broken:
            self._drift(rec, broken)
            return
        ready = [
            tr for tr in rec.targets.values()
            if tr.state == PENDING and tr.target.module in sys.modules
        ]
        if not ready:
            return
        resolved = {}
        for tr in ready:
            try:
                owner, attr, raw, had_own = resolve(tr.target)
            except TargetAbsent as exc:
                self._drift(rec, {tr.target.spec: f"target absent: {exc}"})
                return
            mark = self.is_ours(raw)
            if mark == rec.spec.id:
                tr.state, tr.reason = APPLIED, "already patched (one layer kept)"
                continue
            resolved[tr.target.spec] = (owner, attr, raw, had_own)
        if resolved:
            self._run_plan(rec, resolved)

    def _run_plan(self, rec: PatchRecord, resolved: dict) -> None:
        spec = rec.spec
        ctx = PatchContext(
            patch_id=spec.id,
            targets=tuple(resolved),
            platform=self.platform,
            versions={d: _installed(d) for d in spec.requires},
            logger=init_logger(f"drama3_patches.patches.{spec.id}"),
            _resolve=lambda t: resolved[t][2],
            _owner=lambda t: resolved[t][:2],
        )
        try:
            plan_fn = _load_callable(spec.implementation)
            replacements = plan_fn(ctx)
            if not isinstance(replacements, dict):
                raise TypeError(f"plan() returned {type(replacements).__name__}, expected a dict")
            extra = set(replacements) - set(resolved)
            if extra:
                raise ValueError(f"plan() returned targets it was not given: {sorted(extra)}")
        except NotNeeded as exc:
            for t in resolved:
                tr = rec.targets[t]
                tr.state, tr.reason = NOT_NEEDED, f"upstream fix detected: {exc}"
            return
        except Exception as exc:
            self._fail(rec, list(resolved), exc)
            return
        installed: list[TargetRecord] = []
        try:
            for t, repl in replacements.items():
                owner, attr, raw, had_own = resolved[t]
                tr = rec.targets[t]
                self._mark(repl, spec.id)
                setattr(owner, attr, repl)
                tr.owner, tr.attr, tr.original, tr.had_own, tr.replacement = owner, attr, raw, had_own, repl
                tr.aliases = []
                installed.append(tr)
                tr.state, tr.reason = APPLIED, "patched"
        except Exception as exc:
            self._restore(rec, installed)  # all or none
            self._fail(rec, list(resolved), exc)
            return
        for t in resolved:
            if t not in replacements:
                tr = rec.targets[t]
                tr.state = NOT_NEEDED
                tr.reason = ctx.left.get(t, "the patch found nothing to change here")
        for tr in installed:
            self._rebind_aliases(tr)
            logger.info("drama3-patches: %s applied to %s", spec.id, tr.target.spec)

    def _drift(self, rec: PatchRecord, missing: dict[str, str]) -> None:
        """Targets missing inside the version range: the whole patch fails (all or none), naming them."""
        for spec, why in missing.items():
            tr = rec.targets[spec]
            tr.state, tr.reason = FAILED, why
        names = ", ".join(missing)
        self._restore(rec, [tr for tr in rec.targets.values() if tr.state == APPLIED])
        for tr in rec.targets.values():
            if tr.state in (PENDING, SKIPPED):
                tr.state, tr.reason = FAILED, f"{ALONGSIDE} {names} is missing (a patch applies all or none)"
        versions = ", ".join(f"{d} {_installed(d)}" for d in rec.spec.requires)
        causes = "; ".join(dict.fromkeys(missing.values()))  # one line per module, not per target
        self._fail(rec, [], TargetAbsent(
            f"{causes} (installed: {versions}; the manifest's range admits them, "
            "so the target moved or the code changed: update the manifest's targets or its version range)"
        ))

    def _fail(self, rec: PatchRecord, targets: list[str], exc: BaseException) -> None:
        cause = f"{type(exc).__name__}: {exc}"
        for t in targets:
            tr = rec.targets[t]
            tr.state, tr.reason = FAILED, cause
        if env.strict():
            raise PatchError(f"drama3-patches: patch {rec.spec.id!r} failed to apply: {cause}") from exc
        logger.warning(
            "drama3-patches: patch %s failed to apply (%s); the original code is left in place. "
            "Set %s=1 to make this an error.", rec.spec.id, cause, env.STRICT,
        )

    # -- installing and restoring --------------------------------------------
    def _mark(self, repl: Any, patch_id: str) -> None:
        self._ours[id(repl)] = (patch_id, repl)
        try:
            setattr(repl, MARKER, patch_id)
        except (AttributeError, TypeError):
            pass  # e.g. a property: the identity registry above still knows it

    def _still_bound(self, tr: TargetRecord) -> bool:
        try:
            owner, attr, raw, _ = resolve(tr.target)
        except TargetAbsent:
            return False
        return raw is tr.replacement

    def _restore(self, rec: PatchRecord, trs: list[TargetRecord]) -> None:
        for tr in reversed(trs):
            if tr.state != APPLIED or tr.replacement is None:
                continue
            current = getattr(tr.owner, "__dict__", {}).get(tr.attr)
            if current is tr.replacement:
                if tr.had_own:
                    setattr(tr.owner, tr.attr, tr.original)
                else:
                    delattr(tr.owner, tr.attr)
            elif current is not None:
                logger.warning(
                    "drama3-patches: %s was replaced by someone else after %s patched it; left as is",
                    tr.target.spec, rec.spec.id,
                )
            if isinstance(tr.owner, type(sys)):
                # Names bound by `from x import f` after the patch (the importer
                # saw the replacement) go back to the original too.
                for module_name, name in _bindings_of(tr.replacement, skip=tr.owner):
                    sys.modules[module_name].__dict__[name] = tr.original
            tr.state, tr.reason = PENDING, "restored"
            tr.replacement, tr.aliases = None, []

    def _rebind_aliases(self, tr: TargetRecord) -> None:
        """Names bound by an earlier ``from x import f`` still point at the original: rebind them."""
        original = tr.original
        if not isinstance(tr.owner, type(sys)) or original is None:
            return  # only module-level objects are imported by name
        for module_name, name in _bindings_of(original, skip=tr.owner):
            sys.modules[module_name].__dict__[name] = tr.replacement
            tr.aliases.append((module_name, name))
        if tr.aliases:
            logger.info(
                "drama3-patches: also rebound %s in %s",
                tr.target.spec, ", ".join(f"{m}.{n}" for m, n in tr.aliases),
            )

    # -- state bookkeeping ----------------------------------------------------
    @staticmethod
    def _snapshot(rec: PatchRecord) -> tuple:
        return (rec.state, rec.reason, tuple((t.state, t.reason) for t in rec.targets.values()))

    @staticmethod
    def _settle(rec: PatchRecord) -> None:
        """Derive the patch's state from its targets'."""
        trs = list(rec.targets.values())
        states = [t.state for t in trs]
        # A target that failed for its own cause speaks for the patch before one failed alongside it.
        ordered = sorted(trs, key=lambda t: t.reason.startswith(ALONGSIDE))
        first = {s: next(t for t in ordered if t.state == s) for s in states}
        pending = [t.target.spec for t in trs if t.state == PENDING]
        if FAILED in first:
            rec.state, rec.reason = FAILED, f"{first[FAILED].target.spec}: {first[FAILED].reason}"
        elif APPLIED in first:
            rec.state = APPLIED
            rec.reason = "patched" if not pending else f"patched; waiting for {', '.join(pending)}"
        elif SKIPPED in first:
            rec.state, rec.reason = SKIPPED, first[SKIPPED].reason
        elif NOT_NEEDED in first and not pending:
            rec.state, rec.reason = NOT_NEEDED, first[NOT_NEEDED].reason
        else:
            rec.state = PENDING
            rec.reason = "waiting for import of " + ", ".join(
                dict.fromkeys(t.target.module for t in trs if t.state == PENDING)
            )

    def _after_change(self, rec: PatchRecord, before: tuple) -> None:
        if self._snapshot(rec) != before:
            write_report(self)

    def import_targets(self) -> dict[str, str]:
        """Import every target module (for ``status --import-targets``); call ``status()`` after."""
        errors: dict[str, str] = {}
        for module in dict.fromkeys(m for p in self.manifest.patches for m in p.modules):
            try:
                importlib.import_module(module)
            except PatchError:
                raise
            except Exception as exc:  # ImportError and whatever a broken module raises
                errors[module] = f"{type(exc).__name__}: {exc}"
        # The next evaluation (``status()``) reports these targets as skipped, with the error.
        self._import_errors.update(errors)
        return errors

    # -- reporting ---------------------------------------------------------------
    def status(self) -> dict:
        if self.enabled():
            self.activate()
        else:
            for rec in self.records.values():
                self._evaluate(rec)
        return self.snapshot()

    def snapshot(self) -> dict:
        dists = sorted({d for p in self.manifest.patches for d in p.requires} | {"vllm", "vllm-ascend", "vllm-omni", "torch"})
        return {
            "enabled": self.enabled(),
            "platform": self.platform,
            "versions": {d: _installed(d) for d in dists},
            "pid": os.getpid(),
            "manifest": str(self.manifest.path),
            "patches": [
                {
                    "id": rec.spec.id,
                    "state": rec.state,
                    "reason": rec.reason,
                    "targets": [t.spec for t in rec.spec.targets],
                    "requires": dict(rec.spec.requires),
                    "platforms": list(rec.spec.platforms),
                    "target_states": {s: tr.as_dict() for s, tr in rec.targets.items()},
                }
                for rec in self.records.values()
            ],
        }


def _bindings_of(obj: Any, skip: Any) -> list[tuple[str, str]]:
    """(module, name) of every module-level name bound to ``obj`` outside ``skip``."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module is skip:
            continue
        try:
            namespace = module.__dict__
        except Exception:
            continue
        for name, value in list(namespace.items()):
            if value is obj:
                found.append((module_name, name))
    return found


def _installed(dist: str) -> str | None:
    from drama3_patches.versions import installed_version

    return installed_version(dist)


def _load_callable(path: str):
    module_name, func = path.split(":")
    return getattr(importlib.import_module(module_name), func)


_report_lock = threading.Lock()


def write_report(engine: Engine) -> None:
    """Write ``$DRAMA3_PATCHES_REPORT_DIR/<pid>.json`` (atomically) if the variable is set."""
    directory = os.environ.get(env.REPORT_DIR)
    if not directory:
        return
    with _report_lock:
        try:
            os.makedirs(directory, exist_ok=True)
            data = engine.snapshot()
            data["argv"] = list(sys.argv)
            data["written_at"] = time.time()
            path = os.path.join(directory, f"{os.getpid()}.json")
            tmp = f"{path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as exc:
            env.warn_once("report-dir", f"cannot write the status report to {directory}: {exc}")


_ENGINE: Engine | None = None
_ENGINE_LOCK = threading.Lock()


def get_engine() -> Engine:
    global _ENGINE
    if _ENGINE is None:
        with _ENGINE_LOCK:
            if _ENGINE is None:
                _ENGINE = Engine()
    return _ENGINE


def on_import(module_name: str) -> None:
    """The import trigger's hook (``_bootstrap.HOOK``)."""
    get_engine().on_import(module_name)


def activate() -> None:
    """Activation by the ``.pth`` hook or the vLLM plugin (``_bootstrap.ACTIVATE``)."""
    get_engine().activate()
