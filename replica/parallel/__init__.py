"""Parallelism inside a stage on torch's engines: the device mesh, tensor parallelism, FSDP2, data-parallel sync."""
