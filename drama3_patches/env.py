"""The environment contract (docs/design.md): variable names, flag parsing, warnings.

A leaf: standard library only, and it imports nothing of this package, so the
``.pth`` hook, the engine and the tools all read the environment the same way.
The bounded file reader is ``drama3_patches.reader``; its names are still reachable here. The
manifest in force is the start-up hook's to say (``_bootstrap.manifest_path``), which must not
import this module on its common path: one owner, no circle.
"""

import os
import sys

ENABLE = "DRAMA3_PATCHES"
DISABLE = "DRAMA3_PATCHES_DISABLE"
STRICT = "DRAMA3_PATCHES_STRICT"
PLATFORM = "DRAMA3_PATCHES_PLATFORM"
REPORT_DIR = "DRAMA3_PATCHES_REPORT_DIR"
# Seconds a gone process's report (and a dead writer's temporary file) stays in the report folder.
REPORT_RETENTION = "DRAMA3_PATCHES_REPORT_RETENTION"
REPORT_RETENTION_DEFAULT_S = 86400.0
MANIFEST = "DRAMA3_PATCHES_MANIFEST"
TP_CHECK = "DRAMA3_PATCHES_TP_CHECK"
RESUME_CHECK = "DRAMA3_PATCHES_RESUME_CHECK"
# On by default: set off, the eager kernels skip torch-npu's fused norms (drama3_patches.kernels.npu_fused).
NPU_FUSED = "DRAMA3_PATCHES_NPU_FUSED"
# native | cpu: which route fp8-expert-method gives block-FP8 experts (default: by feature).
FP8_ROUTE = "DRAMA3_PATCHES_FP8_ROUTE"
# Test-only fault injection: a runtime check that never saw its fault cannot be trusted to pass.
FAULT = "DRAMA3_PATCHES_FAULT"
FAULTS = ("parked-history", "wrong-slot", "tp-drift")

TRUE = ("1", "true", "yes", "on")
FALSE = ("", "0", "false", "no", "off")
PLATFORMS = ("npu", "cuda", "cpu")

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """One stderr line per key and process (logging may not be configured this early)."""
    if key not in _warned:
        _warned.add(key)
        sys.stderr.write(f"drama3-patches: warning: {message}\n")


def soft_failure(what: str, exc: BaseException) -> None:
    """An error of ours inside the host's import: raised under STRICT, else one warning per process.

    Outside DRAMA3_PATCHES_STRICT=1 nothing the package does may make the host's
    import fail; the process goes on with the original code.
    """
    if strict():
        raise exc
    cause = " ".join(str(exc).split())  # one line, even for YAML's multi-line messages
    warn_once(
        "soft-failure",
        f"{what}: {type(exc).__name__}: {cause}; the import proceeds unpatched "
        f"(fix the cause, or set {STRICT}=1 to make this an error)",
    )


def flag_value(raw: str | None) -> bool | None:
    """True / False for an accepted spelling, None for one that is not understood."""
    value = (raw or "").strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    return None


def parse_flag(name: str) -> bool:
    """Read a boolean variable as docs/design.md says; bad values warn once and count as off."""
    raw = os.environ.get(name)
    value = flag_value(raw)
    if value is None:
        warn_once(
            name,
            f"{name}={raw!r} is not understood; accepted values are "
            f"{'/'.join(TRUE)} (enable) or {'/'.join(v for v in FALSE if v)}/empty "
            "(disable); treating it as disabled",
        )
        return False
    return value


def enabled() -> bool:
    return parse_flag(ENABLE)


def strict() -> bool:
    return parse_flag(STRICT)


def tp_check() -> bool:
    """Compare each step's sampled frames across the tensor-parallel group (off by default)."""
    return parse_flag(TP_CHECK)


def resume_check() -> bool:
    """Verify that a resumed request is fed back the frames it had when preempted (off by default)."""
    return parse_flag(RESUME_CHECK)


def npu_fused() -> bool:
    """Whether the eager kernels may use torch-npu's fused norms on an NPU: unset or empty is on
    (the default), a bad value warns once and counts as off, like every flag here."""
    if not os.environ.get(NPU_FUSED, "").strip():
        return True
    return parse_flag(NPU_FUSED)


def report_retention() -> float:
    """$DRAMA3_PATCHES_REPORT_RETENTION in seconds: unset or empty is a day; 0 keeps every report;
    anything else but a finite number >= 0 warns once and counts as the default."""
    raw = os.environ.get(REPORT_RETENTION, "").strip()
    if not raw:
        return REPORT_RETENTION_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        warn_once(REPORT_RETENTION, f"{REPORT_RETENTION}={raw!r} is not a number of seconds >= 0 "
                  f"(0 keeps every report); using {REPORT_RETENTION_DEFAULT_S:.0f}")
        return REPORT_RETENTION_DEFAULT_S
    return value


def fault_problem() -> str | None:
    """Why $DRAMA3_PATCHES_FAULT is refused (a name that is not one of FAULTS), or None."""
    parts = [part.strip() for part in os.environ.get(FAULT, "").split(",") if part.strip()]
    unknown = [part for part in parts if part not in FAULTS]
    if unknown:
        return (f"{FAULT}={os.environ.get(FAULT)!r}: {', '.join(map(repr, unknown))} is not a known fault; "
                f"known: {', '.join(FAULTS)} (test-only; unset it on a server)")
    return None


def fault(name: str) -> bool:
    """Whether the test-only fault ``name`` (one of FAULTS) is switched on in $DRAMA3_PATCHES_FAULT.
    A value naming an unknown fault switches none on, with one warning: a misspelt negative
    control must not run as a normal run unnoticed."""
    problem = fault_problem()
    if problem:
        warn_once(FAULT, f"{problem}; no fault is injected")
        return False
    return name in {part.strip() for part in os.environ.get(FAULT, "").split(",")}


def disabled_ids() -> set[str]:
    raw = os.environ.get(DISABLE, "")
    return {part.strip() for part in raw.split(",") if part.strip()}


def platform_override() -> str | None:
    """The platform $DRAMA3_PATCHES_PLATFORM names, None when unset; a bad value warns once."""
    raw = os.environ.get(PLATFORM, "").strip().lower()
    if not raw:
        return None
    if raw in PLATFORMS:
        return raw
    warn_once(PLATFORM, f"{PLATFORM}={raw!r} is not one of {'|'.join(PLATFORMS)}; detecting instead")
    return None


# Names that lived here before the reader had its own module; looked up only when asked for,
# so the environment contract imports nothing of the package.
_READER_NAMES = ("MANIFEST_MAX_BYTES", "MIB", "UnreadableFile", "read_regular", "read_text", "read_manifest_text")


def __getattr__(name):
    if name in _READER_NAMES:
        from drama3_patches import reader

        return getattr(reader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
