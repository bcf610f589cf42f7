"""Helpers shared by the unit and end-to-end tests (one helper per need). Scripts the tests run
as programs live in scripts/, apart: run from here, a helper module (http.py) would shadow the
standard library module of the same name on the script's sys.path."""
