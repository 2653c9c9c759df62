"""One-off studies: each module is a script (``python -m bench.studies.NAME``) whose
figures are quoted in docs/ or bench/README.md."""
