"""Device backends: act on the device and the process groups; never decide."""

# This folder is the source of ``ftengine.backends`` (pyproject's package-dir; a symlink
# ftengine/backends points here for tools run from the repository root). Imported under any
# other name, the same files would load a second time as unrelated modules.
if __name__ != "ftengine.backends":
    raise ImportError(
        f"{__name__!r} is the source folder of ftengine.backends; import ftengine.backends instead"
    )
