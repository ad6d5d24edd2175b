# qforensics record: attach capture hooks inside an unmodified Python program.
# This directory is put first on PYTHONPATH by `qforensics record` (or by hand, see
# `qforensics record --print-env`); Python imports this file at start-up. It chains to any other
# sitecustomize further down sys.path so the program's own start-up hooks still run.
import os as _os
import sys as _sys


def _qf_chain() -> None:
    import importlib.machinery
    import importlib.util

    here = _os.path.dirname(_os.path.abspath(__file__))
    rest = [p for p in _sys.path if _os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)


if _os.environ.get("QFORENSICS_TRACE"):
    try:
        from qforensics.autoattach import install as _qf_install

        _qf_install()
    except Exception as _exc:  # never break the program we were asked to watch
        _sys.stderr.write(f"qforensics: could not install capture hooks: {_exc}\n")
try:
    _qf_chain()
except Exception as _exc:
    _sys.stderr.write(f"qforensics: chained sitecustomize failed: {_exc}\n")
