"""drama3-patches: Fish Audio Drama 3 on Ascend NPUs with vLLM-Omni, as import-time patches.

Importing this package does nothing but define names: the engine loads lazily,
so the ``.pth`` start-up hook stays cheap.

    import drama3_patches
    drama3_patches.apply()            # patch now (and on later imports), whatever DRAMA3_PATCHES says
    drama3_patches.status()           # the ``drama3-patches status --json`` dict
    drama3_patches.get_original("module:Qualified.name")
    drama3_patches.unapply()          # restore the exact originals
"""

__version__ = "0.1.0"

__all__ = ["apply", "unapply", "status", "get_original", "is_patched", "__version__"]


def apply(ids=None) -> None:
    """Enable the patches in this process (all, or the ids given) and patch what is imported."""
    from drama3_patches.engine import get_engine

    get_engine().activate(ids, force=True)


def unapply(ids=None) -> None:
    """Restore the original objects of the patches given (default: all)."""
    from drama3_patches.engine import get_engine

    get_engine().unapply(ids)


def status() -> dict:
    """This process's patch status, in the ``--json`` shape of docs/design.md."""
    from drama3_patches.engine import get_engine

    return get_engine().status()


def get_original(target: str):
    """The object a patch replaced at ``target`` (``module:Qualified.name``)."""
    from drama3_patches.engine import get_engine

    return get_engine().get_original(target)


def is_patched(target: str) -> bool:
    try:
        get_original(target)
    except KeyError:
        return False
    return True
