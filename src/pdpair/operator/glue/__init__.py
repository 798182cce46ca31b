"""kopf and process glue: the handlers, wraps of kopf internals, the process's memory settings."""
