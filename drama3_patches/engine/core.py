"""Guards and orchestration: which patches run, in what order, and what happens when one fails.

The ``Engine`` reads the manifest, runs each patch through the guard chain
(enabled, disabled list, platform, versions, target present, feature detection
in ``plan``), hands the targets to the patch's ``plan(ctx)`` and passes its
answer to the install room; the state room records and reports the outcome.
It knows the manifest and the ``plan(ctx)`` protocol of ``patchlib``, nothing
about any particular patch.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import threading
from typing import Any, Iterable

from drama3_patches import env
from drama3_patches._bootstrap import install_trigger, installed_finder, note_activation
from drama3_patches.engine.install import Installer, Resolved, TargetAbsent, resolve, still_executing
from drama3_patches.engine.state import (
    ALONGSIDE,
    APPLIED,
    FAILED,
    NOT_NEEDED,
    PATCHED_NOTE,
    PENDING,
    SKIPPED,
    PatchRecord,
    build_records,
    fingerprint,
    installed,
    settle,
    snapshot,
    write_report,
)
from drama3_patches.logger import init_logger
from drama3_patches.manifest import Manifest, load_manifest
from drama3_patches.patchlib import NotNeeded, PatchContext

logger = init_logger(__name__)


class PatchError(RuntimeError):
    """Raised under DRAMA3_PATCHES_STRICT=1 when a needed patch fails to apply."""


class Engine:
    def __init__(self, manifest: Manifest | None = None):
        self._manifest = manifest
        self._manifest_error: Exception | None = None
        self.forced: set[str] = set()  # ids apply() enabled in this process, whatever the environment says
        self._records: dict[str, PatchRecord] | None = None
        self._installer = Installer()
        self._init_lock = threading.Lock()
        self._platform: str | None = None
        self._import_errors: dict[str, str] = {}  # module -> why `import_targets` could not import it
        self._triggers_synced = False
        self._range_told = False  # the out-of-range warning (once per process, at the first target import)

    # -- lazily built state ------------------------------------------------
    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            if self._manifest_error is not None:
                raise self._manifest_error  # read once: a broken manifest is not re-read at every import
            try:
                self._manifest = load_manifest()
            except Exception as exc:
                self._manifest_error = exc
                raise
        return self._manifest

    def new_locks(self) -> None:
        """Fresh locks in a forked child: one another thread held at fork() would never be released."""
        self._init_lock = threading.Lock()
        for rec in (self._records or {}).values():
            rec.lock = threading.RLock()

    @property
    def records(self) -> dict[str, PatchRecord]:
        if self._records is None:
            with self._init_lock:
                if self._records is None:
                    self._records = build_records(self.manifest)
        return self._records

    @property
    def platform(self) -> str:
        if self._platform is None:
            from drama3_patches.platform import current_platform

            self._platform = current_platform()
        return self._platform

    def enabled(self, rec: PatchRecord | None = None) -> bool:
        """The environment enables us, or apply() forced ``rec`` (without ``rec``: forced any)."""
        if env.enabled():
            return True
        return rec.spec.id in self.forced if rec is not None else bool(self.forced)

    # -- entry points --------------------------------------------------------
    def activate(self, ids: Iterable[str] | None = None, force: bool = False) -> None:
        """Install import triggers and patch every target already imported."""
        selected = self._select(ids)
        for rec in selected:
            if force:
                # Only the ids given: forcing the whole engine would let every trigger apply the rest.
                self.forced.add(rec.spec.id)
                with rec.lock:
                    rec.removed = False
                    # apply() is the one way back from failed, and it re-plans the whole patch.
                    for tr in rec.targets.values():
                        if tr.state == FAILED:
                            tr.state, tr.reason = PENDING, "re-planned by drama3_patches.apply()"
        if self.enabled():
            note_activation("api")  # no-op when a start-up route (.pth, sitecustomize, plugin) came first
            install_trigger(m for rec in self.records.values() if self.enabled(rec) for m in rec.spec.modules)
        for rec in selected:
            self._evaluate(rec)

    def on_import(self, module_name: str) -> None:
        """Called by the import trigger after ``module_name`` executed (import or reload)."""
        if not self._triggers_synced:
            self._sync_triggers()
        if not self._range_told:
            self._range_told = True
            self._tell_out_of_range()
        for rec in self.records.values():
            if module_name not in rec.spec.modules:
                continue
            with rec.lock:
                for tr in rec.targets.values():
                    # A failed target stays failed: one withdrawn alongside another module's failure
                    # must not be planned on its own when its module arrives (all or none).
                    if tr.target.module == module_name and tr.state not in (APPLIED, FAILED):
                        tr.state, tr.reason = PENDING, "target module re-executed"
            self._evaluate(rec, executed=module_name)

    def _tell_out_of_range(self) -> None:
        """On a vLLM or vLLM-Omni outside every patch's reviewed range, say so once: otherwise the
        deployment fails further on (e.g. tensor parallel refused) with nothing saying why."""
        from drama3_patches import reviewed
        from drama3_patches.versions import installed_version

        try:
            said = reviewed.verdict(self.manifest)
        except Exception as exc:  # a warning is never worth the host's import
            logger.debug("drama3-patches: reviewed-range check failed: %s", exc)
            return
        if said:
            versions = ", ".join(f"{d} {installed_version(d) or 'not installed'}" for d in reviewed.WATCHED)
            env.warn_once("out-of-range", f"{said} (installed: {versions}); run `drama3-patches doctor` "
                                          "for what to do")

    def _sync_triggers(self) -> None:
        """At the first trigger: trigger every module the manifest names now.

        The start-up list may be older than the manifest (a cache entry, an edit since start):
        a module it lacks gets its trigger here, and one imported already is patched now. A
        module it names that the manifest no longer does only ever reaches ``on_import``, which
        finds no patch for it.
        """
        self._triggers_synced = True
        finder = installed_finder()
        if finder is None or not self.enabled():
            return
        missing = {m for rec in self.records.values() if self.enabled(rec) for m in rec.spec.modules} - finder.modules
        if not missing:
            return
        finder.add(missing)
        for rec in self.records.values():
            if any(m in missing and m in sys.modules for m in rec.spec.modules):
                self._evaluate(rec)

    def unapply(self, ids: Iterable[str] | None = None) -> None:
        for rec in self._select(ids):
            with rec.lock:
                before = fingerprint(rec)
                self._installer.restore(rec.spec.id, list(rec.targets.values()))
                rec.removed = True
                self._settled(rec, before)

    def get_original(self, target_spec: str) -> Any:
        for rec in self.records.values():
            tr = rec.targets.get(target_spec)
            if tr is not None and tr.state == APPLIED:
                return tr.original
        raise KeyError(f"{target_spec} is not patched in this process")

    def is_ours(self, obj: Any) -> str | None:
        """The patch id that produced ``obj`` (or wraps it), else None."""
        return self._installer.is_ours(obj)

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
        # The next evaluation (``status()``) reports these targets as drift, with the error.
        self._import_errors.update(errors)
        return errors

    def status(self) -> dict:
        if self.enabled():
            self.activate()
        else:
            for rec in self.records.values():
                self._evaluate(rec)
        return self.snapshot()

    def snapshot(self) -> dict:
        return snapshot(enabled=self.enabled(), platform=self.platform,
                        manifest=self.manifest, records=self.records)

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
        if not self.enabled(rec):
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

    def _evaluate(self, rec: PatchRecord, executed: str | None = None) -> None:
        with rec.lock:
            before = fingerprint(rec)
            try:
                self._evaluate_locked(rec, executed)
            finally:
                self._settled(rec, before)

    def _settled(self, rec: PatchRecord, before: tuple) -> None:
        settle(rec)
        if fingerprint(rec) != before:
            write_report(self)

    def _evaluate_locked(self, rec: PatchRecord, executed: str | None = None) -> None:
        """``executed``: the module whose trigger called us (its body has run, though importlib
        still marks it initializing until the trigger returns)."""
        skip = self._guard(rec)
        if skip is not None:
            for tr in rec.targets.values():
                if tr.state not in (APPLIED, FAILED):  # a failure keeps its cause until apply()
                    tr.state, tr.reason = SKIPPED, skip
            return
        # A reload puts a fresh original where our replacement was: patch it again.
        for tr in rec.targets.values():
            if tr.state == APPLIED and not self._installer.still_bound(tr):
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
        ready = []
        for tr in rec.targets.values():
            if tr.state != PENDING or tr.target.module not in sys.modules:
                continue
            if tr.target.module != executed and still_executing(sys.modules[tr.target.module]):
                # Another thread (or an import further up this one's stack) is still running the
                # module's body: its names may not exist yet, which is not drift.  Its own trigger
                # (or the next evaluation) comes back to it once the body has run.
                tr.reason = "target module still executing"
                continue
            ready.append(tr)
        if not ready:
            return
        resolved: dict[str, Resolved] = {}
        for tr in ready:
            try:
                where = resolve(tr.target)
            except TargetAbsent as exc:
                self._drift(rec, {tr.target.spec: f"target absent: {exc}"})
                return
            if self.is_ours(where.raw) == rec.spec.id:
                tr.state, tr.reason = APPLIED, "already patched (one layer kept)"
                continue
            resolved[tr.target.spec] = where
        if resolved:
            self._run_plan(rec, resolved)

    def _run_plan(self, rec: PatchRecord, resolved: dict[str, Resolved]) -> None:
        spec = rec.spec
        ctx = PatchContext(
            patch_id=spec.id,
            targets=tuple(resolved),
            platform=self.platform,
            versions={d: installed(d) for d in spec.requires},
            logger=init_logger(f"drama3_patches.patches.{spec.id}"),
            _resolve=lambda t: resolved[t].raw,
            _owner=lambda t: (resolved[t].owner, resolved[t].attr),
        )
        try:
            replacements = pkgutil.resolve_name(spec.implementation)(ctx)
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
        try:
            done = self._installer.install(
                spec.id, [(rec.targets[t], resolved[t], repl) for t, repl in replacements.items()]
            )
        except Exception as exc:  # the installer put back what it had set: all or none
            self._fail(rec, list(resolved), exc)
            return
        for t in resolved:
            if t not in replacements:
                tr = rec.targets[t]
                tr.state = NOT_NEEDED
                tr.reason = ctx.left.get(t, "the patch found nothing to change here")
        for tr in done:
            if ctx.notes.get(tr.target.spec):
                tr.reason = f"{PATCHED_NOTE}{ctx.notes[tr.target.spec]}"
            self._installer.rebind_aliases(tr)
            logger.info("drama3-patches: %s applied to %s", spec.id, tr.target.spec)

    def _drift(self, rec: PatchRecord, missing: dict[str, str]) -> None:
        """Targets missing inside the version range: the whole patch fails (all or none), naming them."""
        for spec, why in missing.items():
            tr = rec.targets[spec]
            tr.state, tr.reason = FAILED, why
        self._withdraw(rec, f"{', '.join(missing)} is missing")
        versions = ", ".join(f"{d} {installed(d)}" for d in rec.spec.requires)
        causes = "; ".join(dict.fromkeys(missing.values()))  # one line per module, not per target
        self._fail(rec, [], TargetAbsent(
            f"{causes} (installed: {versions}; the manifest's range admits them, "
            "so the target moved or the code changed: update the manifest's targets or its version range)"
        ))

    def _withdraw(self, rec: PatchRecord, why: str) -> list[str]:
        """All or none across modules: restore the targets an earlier run applied, fail the rest alongside."""
        applied = [tr for tr in rec.targets.values() if tr.state == APPLIED]
        self._installer.restore(rec.spec.id, applied)
        for tr in rec.targets.values():
            if tr.state in (PENDING, SKIPPED):  # restore() leaves the restored ones pending
                tr.state, tr.reason = FAILED, f"{ALONGSIDE} {why} (a patch applies all or none)"
        return [tr.target.spec for tr in applied]

    def _fail(self, rec: PatchRecord, targets: list[str], exc: BaseException) -> None:
        cause = f"{type(exc).__name__}: {exc}"
        for t in targets:
            tr = rec.targets[t]
            tr.state, tr.reason = FAILED, cause
        # plan() runs once per target module: a failure in a later run undoes the earlier runs.
        restored = self._withdraw(rec, f"{rec.spec.id} failed on {', '.join(targets)}") if targets else []
        if restored:
            logger.warning("drama3-patches: %s: restored the originals of %s, applied by an earlier run",
                           rec.spec.id, ", ".join(restored))
        if env.strict():
            raise PatchError(f"drama3-patches: patch {rec.spec.id!r} failed to apply: {cause}") from exc
        logger.warning(
            "drama3-patches: patch %s failed to apply (%s); the original code is left in place. "
            "Set %s=1 to make this an error.", rec.spec.id, cause, env.STRICT,
        )
