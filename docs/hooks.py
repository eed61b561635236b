"""MkDocs hook: the benchmarks page is rendered from one run's JSON at build time."""
