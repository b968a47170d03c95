"""Pages of the docs site that are generated, never hand-copied: the spec reference (from the pydantic models)
and the performance tables (from `.bench/*.json`). `make docs` runs them; tests/unit/test_docs.py checks."""
