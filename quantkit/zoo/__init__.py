"""Reference models used by quantkit's configs, tests and benchmarks. Importing a submodule imports torch."""
