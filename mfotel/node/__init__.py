"""One node of a job: the `mfotel-instrument` launcher and the node agent it runs beside the
ranks (each rank's process state, how it ended, liveness, CPU and memory, stacks). Importing
this package imports nothing."""
