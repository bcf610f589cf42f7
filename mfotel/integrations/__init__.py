"""Integrations with training frameworks: mindformers (callback registration, native metrics
bridge, YAML check, `mfotel-instrument` launcher). Importing this package imports nothing."""
