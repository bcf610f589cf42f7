"""Fast tests: no MindSpore training, no external servers (`make test-fast`)."""
