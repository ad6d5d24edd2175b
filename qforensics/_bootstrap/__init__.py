"""The start-up hook of `qforensics record`: this folder goes first on the recorded program's
PYTHONPATH, and Python imports its `sitecustomize` at start-up, which installs capture
(qforensics.autoattach). A package so that the import rules (pyproject.toml, import-linter) see
what it imports; nothing in qforensics imports it."""
