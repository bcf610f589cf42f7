"""Integrations with training frameworks: mindformers (`mindformers.register()`, the native
metrics bridge, the YAML check). Importing this package imports nothing."""
